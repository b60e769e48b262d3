# temporary (deleted after the device run): old vs new custom backward, CPU and CUDA
import torch, sys, importlib.util
import bench, dram as new
spec = importlib.util.spec_from_file_location("dram_old", "_old_dram_tmp.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device(sys.argv[1])
if len(sys.argv) > 2: torch.set_num_threads(int(sys.argv[2]))
A = type('A', (), {'min_run_time': 1.0, 'rounds': 7})
for N, dk, P in [(129,64,32),(257,64,32),(800,128,32),(129,64,256)]:
    x = bench.make_frame(P, N, dk, dk, dev)
    fns = {"old": old.joint_write, "new": new.joint_write, "solve": bench.write_autograd_solve}
    m = bench.fwd_and_fwdbwd(fns, x, dev, A)['fwdbwd']
    print(dev, N, dk, P, {k: round(v*1e3, 3) for k, v in m[0].items()}, 'old/new', round(bench.ratio(m[1], 'old', 'new'), 3),
          'solve/new', round(bench.ratio(m[1], 'solve', 'new'), 3), 'solve/old', round(bench.ratio(m[1], 'solve', 'old'), 3), flush=True)
if dev.type == 'cuda':
    from torch.profiler import profile, ProfilerActivity
    from dram import DRAMConfig, DRAMLayer
    cfg = DRAMConfig(d_q=384, d_k=384, d_v=384, n_heads=6, head_dk=64, head_dv=64)
    layer = DRAMLayer(cfg).to(dev); B, N, T = 4, 129, 16
    x = torch.randn(B, T, N, 384, device=dev); S0 = torch.randn(B, 6, 64, 64, device=dev)
    with torch.no_grad():
        for _ in range(3): layer(x, x, x, S0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(5): layer(x, x, x, S0)
            torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=40))

"""
Speed and memory of DRAM against its alternatives, measured side by side in ONE run (issue 6).

Every figure is a ratio against a baseline timed in the same process, so it holds on a noisy machine. Timings are
medians of torch.utils.benchmark.Timer.blocked_autorange after a warm-up (the Timer synchronises CUDA itself).

  python bench.py --quick                       # all parts, < 2 min on 2 CPU cores
  python bench.py                               # full grid, < 10 min on 2 CPU cores
  python bench.py --device cuda --out results   # writes results.md and results.json
  python bench.py --quick --profile              # also where the time goes (torch.profiler, top ops)

Parts (sizes from the hosts' configurations: N in {64, 128, 392, 800} write tokens plus the DiT host's 129 / 257,
dk = dv in {64, 128}, batch x heads P from 8 to 256):
  1  joint_write forward / forward+backward against autograd through torch.linalg.solve, autograd through
     torch.linalg.cholesky + cholesky_solve and the token-by-token sequential_delta_write; the N x N (Woodbury)
     path against the dk x dk path for N < dk; achieved GFLOP/s against dense matmul GFLOP/s of the same run.
  2  DRAMLayer.forward over a TBPTT window of T in {8, 16, 32} frames against a loop of DRAMLayer.step.
  3  deployment: per-control-step latency of the DiT host with DRAM at episode step t in {10, 100, 1000} against
     a k-frame context (k in {1, 4, 8, 16}) on the same DiT head, and the persistent memory bytes of each.
  4  training: frames/s of a TBPTT step, DRAM vs memory="none" (cached features), feature cache vs encoding on the
     fly; activation memory vs the window T in {4, 8, 16, 32}.
On CUDA, part 1 also replays the joint write's forward+backward as a CUDA graph and part 3 every policy step (the
launch overhead removed; eval.py deploys policies so on a GPU).
Parts 3-4 run the DiT host at three sizes (--sizes): LIBERO (vit_small_patch16_224.dino at 128 px, 129 tokens x 384),
the embedded default (vit_tiny_patch16_224 at 64 px, 33 tokens x 192), both with train.py's small head (width 128,
4 blocks), and gr00t: a head of GR00T N1.5's size (16 blocks, width 1536, 4 Euler steps) on 393 tokens x 2048
(GPU by default; on the CPU with --sizes gr00t, minutes).
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.benchmark as benchmark

import dram
from dram import DRAMConfig, DRAMLayer, joint_write, sequential_delta_write, write_weights
from hosts import HostConfig, capture_cuda_graph, make_host
from train import DEFAULTS, LIBERO_CHUNK, GraphedTrainStep, make_optimizer, parser, train_step

# ----------------------------------------------------------------------------------------------------------
# Timing, machine description, report
# ----------------------------------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _block(fn, n, device):
    """Seconds per call over a block of n back-to-back calls (device synchronised at both ends)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


def compare(fns, device, min_run_time, rounds=5, warmup=2):
    """Median seconds per call of each fn in `fns` {name: fn}, timed INTERLEAVED: `rounds` rounds, each times one
    block of every fn (order rotated per round). A load change on a shared machine then hits all candidates alike,
    and a ratio is the median of the per-round ratios. Each block lasts about min_run_time / rounds seconds.
    Returns ({name: median s}, {name: [s per round]})."""
    n = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        n[name] = max(1, int(min_run_time / rounds / max(_block(fn, 1, device), 1e-6)))
    per = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            per[name].append(_block(fns[name], n[name], device))
    return {k: statistics.median(v) for k, v in per.items()}, per


def profile_rows(events, cuda, calls, top=10):
    """Profiler events (key_averages) of `calls` calls -> table rows [op, calls per call, self ms per call, % of self
    time] of the `top` ops and a total row. On CUDA only kernels count: an op's device time is its kernels' (counted
    twice otherwise), and a user annotation (e.g. AdamW.step) spans its kernels on the GPU as well."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:  # (is_user_annotation is absent in torch 2.4)
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False)]
    total = sum(getattr(e, key) for e in events)  # microseconds over all calls
    events = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    rows = [[e.key[:80], f"{e.count / calls:g}", f"{getattr(e, key) / calls / 1e3:.3f}",
             f"{100 * getattr(e, key) / total:.1f}"] for e in events]
    return rows + [["(all ops)", "", f"{total / calls / 1e3:.3f}", "100.0"]]


def profile_ops(fns, device, rep, title, calls=5, top=10):
    """--profile: torch.profiler over `calls` calls of each fn {name: fn} after one warm-up call; one report section
    per fn with its `top` ops by self time (on CUDA its `top` kernels by GPU time, on the CPU its ops by CPU time):
    where the time of a timed candidate goes. The profiler's own overhead inflates small ops: compare shares."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    for name, fn in fns.items():
        fn()
        sync(device)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(calls):
                fn()
            sync(device)
        rows = profile_rows(prof.key_averages(), device.type == "cuda", calls, top)
        rep.section(f"{title}: {name}", ["op", "calls per call", "self ms per call", "% of self time"], rows,
                    note=f"torch.profiler, {calls} calls after a warm-up; self time on the "
                    f"{'GPU' if device.type == 'cuda' else 'CPU'} (--profile).")


def ratio(per, slow, fast):
    """Median over rounds of time(slow) / time(fast): > 1 means `fast` is faster."""
    return statistics.median(a / b for a, b in zip(per[slow], per[fast]))


def median_time(fn, device, min_run_time, warmup=3):
    """Median seconds per call of a lone fn: torch.utils.benchmark.Timer.blocked_autorange after a warm-up
    (num_threads set explicitly: the Timer's default is ONE thread; it synchronises CUDA itself)."""
    for _ in range(warmup):
        fn()
    sync(device)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device):
    m = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
        m["cuda"] = torch.version.cuda
    return m


class Report:
    """Collects markdown sections, raw numbers (for --out .json) and PASS/MISS target checks."""

    def __init__(self, info):
        self.info, self.md, self.data, self.targets = info, [], {}, []

    def section(self, title, headers, rows, note=None):
        lines = [f"### {title}", ""]
        if note:
            lines += [note, ""]
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "---|" * len(headers))
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        self.md.append(text)

    def target(self, name, measured, threshold, kind=">="):
        """A target on a ratio of times taken in this run: measured >= threshold, measured <= threshold, or
        kind="within": |measured - 1| <= threshold (e.g. 0.05 = within 5%)."""
        ok = {">=": measured >= threshold, "<=": measured <= threshold, "within": abs(measured - 1) <= threshold}[kind]
        goal = f"within {100 * threshold:g}% of 1x" if kind == "within" else f"{kind} {threshold:g}x"
        self.targets.append({"target": name, "measured": measured, "goal": goal, "pass": ok})
        print(f"{'PASS' if ok else 'MISS'}  {name}: {measured:.3f}x (target {goal})", flush=True)

    def markdown(self):
        head = ["## DRAM benchmark", ""]
        head += [f"- {k}: {v}" for k, v in self.info.items()]
        head.append("")
        out = "\n".join(head) + "\n" + "\n".join(self.md)
        if self.targets:
            out += "\n### Targets\n\n| target | measured | target | result |\n|---|---|---|---|\n"
            out += "".join(
                f"| {t['target']} | {t['measured']:.3f}x | {t['goal']} | {'PASS' if t['pass'] else 'MISS'} |\n"
                for t in self.targets
            )
        return out


def ms(sec):
    return f"{1e3 * sec:.3f}" if sec < 0.01 else f"{1e3 * sec:.1f}"


# ----------------------------------------------------------------------------------------------------------
# Part 1: joint_write against its alternatives
# ----------------------------------------------------------------------------------------------------------


def _gram_and_rhs(S, K, V, w, gamma):
    """The same arrangement as dram._JointWriteWindow (dk path), so that a baseline differs ONLY in the solve and
    in who differentiates it: A = I + K^T W K [P, dk, dk], rhs = K^T W V - K^T W K S_bar [P, dk, dv]."""
    S_bar = gamma[:, None, None] * S  # [P, dk, dv]
    Kw = K * w[..., None]  # [P, N, dk]
    G = Kw.mT @ K  # [P, dk, dk]
    A = G + torch.eye(K.shape[-1], device=K.device, dtype=K.dtype)
    rhs = Kw.mT @ V - G @ S_bar  # [P, dk, dv]
    return S_bar, A, rhs


def write_autograd_solve(S, K, V, w, gamma):
    """(a) eq. (correction) through torch.linalg.solve (LU), autograd differentiates the solve."""
    S_bar, A, rhs = _gram_and_rhs(S, K, V, w, gamma)
    return S_bar + torch.linalg.solve(A, rhs)


def write_autograd_cholesky(S, K, V, w, gamma):
    """(b) eq. (correction) through torch.linalg.cholesky + cholesky_solve, autograd differentiates both."""
    S_bar, A, rhs = _gram_and_rhs(S, K, V, w, gamma)
    return S_bar + torch.cholesky_solve(rhs, torch.linalg.cholesky(A))


def write_autograd_capturable(S, K, V, w, gamma):
    """(d) for Part 1c: eq. (correction) through ops that a CUDA graph can hold (cholesky_ex without its error check,
    two triangular solves; the ops dram.py uses on a GPU), and autograd differentiates them: the capturable
    counterpart of (b), so that the graphed comparison measures the custom backward, not the launches saved."""
    S_bar, A, rhs = _gram_and_rhs(S, K, V, w, gamma)
    L = torch.linalg.cholesky_ex(A).L  # [P, dk, dk]
    Y = torch.linalg.solve_triangular(L, rhs, upper=False)  # L^{-1} rhs
    return S_bar + torch.linalg.solve_triangular(L.mT, Y, upper=True)  # S_bar + A^{-1} rhs


def write_sequential(S, K, V, w, gamma):
    """(c) the token-by-token gated delta rule with the strength b = w / (1 + w) that the odds form maps back to."""
    return sequential_delta_write(S, K, V, w / (1.0 + w), gamma)


def joint_write_flops(P, N, dk, dv, woodbury):
    """Matmul + factorisation flops of ONE forward joint write as dram.py implements it (elementwise ops omitted;
    full GEMMs counted where a SYRK or a triangular matmul could halve them, because that is what runs):
      dk path:  G = (WK)^T K 2N dk^2, U = (WK)^T V 2N dk dv, L^{-1} 4 dk^3/3, G S_bar 2 dk^2 dv,
                L^{-T} (L^{-1} rhs) 4 dk^2 dv
      N path:   B = K~ K~^T 2N^2 dk, L^{-1} 4 N^3/3, K S_bar 2N dk dv, L^{-T} (L^{-1} r) 4N^2 dv, K~^T (.) 2N dk dv
    L^{-1} of an n x n matrix: n^3/3 for the Cholesky factor and n^3 for its inverse as it runs (the CPU's block
    recursion n^3 + 2 f(n/2); on a GPU a triangular solve against I). The appendix's
    O(N dk^2 + N dk dv + dk^3 + dk^2 dv) per head is the dk-path count."""
    if woodbury:
        f = 2 * N * N * dk + 4 * N**3 / 3 + 2 * N * dk * dv + 4 * N * N * dv + 2 * N * dk * dv
    else:
        f = 2 * N * dk * dk + 2 * N * dk * dv + 4 * dk**3 / 3 + 2 * dk * dk * dv + 4 * dk * dk * dv
    return P * f


def matmul_peak_gflops(device, min_run_time):
    """Dense fp32 matmul GFLOP/s of this machine in this run (TF32 off, like the joint write): 2 n^3 flops."""
    n = 2048 if device.type == "cpu" else 8192
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    with dram._exact_fp32():
        t = median_time(lambda: a @ b, device, min_run_time)
    return 2 * n**3 / t / 1e9


def make_frame(P, N, dk, dv, device, seed=0):
    """Inputs of one frame for P = batch x heads: unit keys, gates as DRAMLayer makes them, retention in (0.9, 1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    S = torch.randn(P, dk, dv, generator=g)
    K = F.normalize(torch.randn(P, N, dk, generator=g), dim=-1)  # [P, N, dk] unit rows
    V = torch.randn(P, N, dv, generator=g)
    w = write_weights(torch.sigmoid(torch.randn(P, N, generator=g)))  # eq. (write-gate), beta in (0, 1)
    gamma = 0.9 + 0.1 * torch.rand(P, generator=g)
    return [x.to(device) for x in (S, K, V, w, gamma)]


def fwd_and_fwdbwd(fns, inputs, device, args, rep=None, profile=None):
    """Interleaved timings of every fn(*inputs) in `fns` {name: fn}: forward (no_grad) and forward+backward, where
    the backward returns the gradients of all inputs (torch.autograd.grad: nothing accumulates between calls).
    profile: a title; the forward+backward of each fn is then also profiled (profile_ops).
    Returns {"fwd": (medians, per-round), "fwdbwd": (medians, per-round)}."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    g_out = torch.randn_like(next(iter(fns.values()))(*inputs))  # a fixed upstream gradient dL/dS_new

    def fwd(fn):
        def run():
            with torch.no_grad():
                return fn(*inputs)

        return run

    def fb(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, g_out)

    out = {
        "fwd": compare({k: fwd(f) for k, f in fns.items()}, device, args.min_run_time, args.rounds),
        "fwdbwd": compare({k: fb(f) for k, f in fns.items()}, device, args.min_run_time, args.rounds),
    }
    if profile:
        profile_ops({k: fb(f) for k, f in fns.items() if k != "sequential"}, device, rep, profile)
    return out


def graphed_fwdbwd(fn, inputs, device):
    """fn(*inputs)'s forward+backward captured as one CUDA graph (hosts.capture_cuda_graph); returns its replay,
    whose timing is the GPU's kernel time without Python's launch overhead."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    with torch.no_grad():
        g_out = torch.randn(fn(*inputs).shape, generator=torch.Generator().manual_seed(1))
    g_out = g_out.to(inputs[0].device)  # a fixed upstream gradient dL/dS_new
    graph, _ = capture_cuda_graph(lambda: torch.autograd.grad(fn(*leaves), leaves, g_out), device=device)
    return graph.replay


def part1(args, device, rep):
    # grid: (N, dk) at P = 32 (e.g. B 8 x H 4); DiT host N = 129 / 257; the batch sweep at the DiT host's N
    if args.quick:
        grid = [(64, 64), (129, 64), (257, 64), (392, 64), (64, 128), (800, 128)]
        sweep = [(129, 64, P) for P in (8, 256)]
        seq_max_n = 257  # the token loop is the slowest thing here; in --quick only up to the DiT host's N
    else:
        grid = [(N, dk) for dk in (64, 128) for N in (64, 128, 129, 257, 392, 800)]
        sweep = [(N, 64, P) for N in (129, 257) for P in (8, 64, 256)]
        seq_max_n = 800
    peak = matmul_peak_gflops(device, args.min_run_time)
    rep.data["matmul_peak_gflops"] = peak
    print(f"dense fp32 matmul: {peak:.1f} GFLOP/s", flush=True)

    baselines = ["solve", "cholesky", "sequential"]
    rows, raw = [], []
    for N, dk, P in [(N, dk, 32) for N, dk in grid] + sweep:
        dv = dk
        fns = {
            "joint": joint_write,  # woodbury=None: the N x N system when N < dk
            "solve": write_autograd_solve,
            "cholesky": write_autograd_cholesky,
            "sequential": write_sequential,
        }
        if N > seq_max_n:
            del fns["sequential"]
        prof = (f"Profile of joint_write fwd+bwd and its autograd baselines (N={N}, dk={dk}, P={P})"
                if args.profile and (N, dk, P) == (129, 64, 32) else None)
        res = fwd_and_fwdbwd(fns, make_frame(P, N, dk, dv, device), device, args, rep, prof)
        t_f, t_b = res["fwd"][0]["joint"], res["fwdbwd"][0]["joint"]
        flops = joint_write_flops(P, N, dk, dv, woodbury=N < dk)
        gf = flops / t_f / 1e9
        speedup = {
            m: {p: ratio(res[p][1], m, "joint") for p in ("fwd", "fwdbwd")} for m in baselines if m in fns
        }  # alternative time / joint time, median over rounds
        raw.append({"N": N, "dk": dk, "dv": dv, "P": P, "median_s": {p: res[p][0] for p in res},
                    "speedup_of_joint": speedup, "fwd_gflops": gf, "fwd_frac_of_matmul_peak": gf / peak})
        fmt = lambda m: f"{speedup[m]['fwd']:.2f} / {speedup[m]['fwdbwd']:.2f}" if m in speedup else "-"
        rows.append([N, dk, P, ms(t_f), ms(t_b)] + [fmt(m) for m in baselines] + [f"{gf:.1f}", f"{100 * gf / peak:.0f}%"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    rep.data["part1_joint_write"] = raw
    rep.section(
        "Part 1a: joint_write vs alternatives (x = alternative time / joint_write time, fwd / fwd+bwd)",
        ["N", "dk=dv", "P=BxH", "joint fwd ms", "joint fwd+bwd ms", "solve x", "cholesky x", "sequential x",
         "fwd GFLOP/s", "% of matmul"],
        rows,
        note=f"solve / cholesky: autograd through torch.linalg.solve / linalg.cholesky + cholesky_solve (same Gram "
        f"and rhs); sequential: token-by-token gated delta rule. N < dk uses the N x N (Woodbury) system. "
        f"Dense fp32 matmul in this run: {peak:.1f} GFLOP/s.",
    )
    for N in (129, 257):
        r = next(r for r in raw if (r["N"], r["dk"], r["P"]) == (N, 64, 32))
        rep.target(f"joint_write fwd+bwd vs autograd linalg.solve, dk=64, N={N}, P=32",
                   r["speedup_of_joint"]["solve"]["fwdbwd"], 1.5)

    if device.type == "cuda":  # launch overhead removed: forward+backward replayed as CUDA graphs
        rows, raw_g = [], []
        for N, dk, P in [(N, dk, 32) for N, dk in grid] + sweep:
            frame = make_frame(P, N, dk, dk, device)
            med, per = compare({"joint": graphed_fwdbwd(joint_write, frame, device),
                                "autograd": graphed_fwdbwd(write_autograd_capturable, frame, device)},
                               device, args.min_run_time, args.rounds)
            eager = next(r for r in raw if (r["N"], r["dk"], r["P"]) == (N, dk, P))["median_s"]["fwdbwd"]
            x, x_solve = ratio(per, "autograd", "joint"), eager["solve"] / med["joint"]
            raw_g.append({"N": N, "dk": dk, "P": P, "joint_graph_s": med["joint"], "eager_s": eager,
                          "autograd_graph_s": med["autograd"], "autograd_graph_over_joint_graph": x,
                          "solve_eager_over_joint_graph": x_solve})
            rows.append([N, dk, P, ms(med["joint"]), ms(eager["joint"]), f"{eager['joint'] / med['joint']:.1f}",
                         ms(med["autograd"]), f"{x:.2f}", ms(eager["solve"]), f"{x_solve:.2f}"])
        rep.data["part1_cuda_graphs"] = raw_g
        rep.section(
            "Part 1c: joint_write forward+backward replayed as a CUDA graph (x = baseline time / joint graph time)",
            ["N", "dk=dv", "P", "joint graph ms", "joint eager ms", "eager / graph", "autograd Cholesky graph ms",
             "x", "solve eager ms", "x vs eager solve"],
            rows,
            note="Forward+backward captured as one CUDA graph and timed by replays: the launch overhead that "
            "dominates the eager timings above is gone. The joint write can be captured because nothing in it waits "
            "for the host (cholesky_ex without an error check, triangular solves, matmuls). 'autograd Cholesky' is "
            "(d): the same Gram and right-hand side through cholesky_ex and two triangular solves, differentiated by "
            "autograd and captured the same way (graph vs graph, interleaved). Autograd through torch.linalg.solve "
            "cannot be captured (it checks A for singularity on the host), nor through solve_ex (its batched LU "
            "makes a call that CUDA forbids during capture), so that column is eager (from Part 1a).",
        )
        for N in (129, 257):
            r = next(r for r in raw_g if (r["N"], r["dk"], r["P"]) == (N, 64, 32))
            rep.target(f"joint_write fwd+bwd vs autograd Cholesky (cholesky_ex + triangular solves), both CUDA graphs, "
                       f"dk=64, N={N}, P=32", r["autograd_graph_over_joint_graph"], 1.5)
            rep.target(f"joint_write fwd+bwd as a CUDA graph vs autograd linalg.solve (eager, not capturable), "
                       f"dk=64, N={N}, P=32", r["solve_eager_over_joint_graph"], 1.5)

    # N x N (Woodbury) system against the dk x dk system, both through joint_write's custom backward
    wood = [(16, 64), (32, 64), (32, 128), (64, 128)] if not args.quick else [(32, 64), (64, 128)]
    rows, raw = [], []
    for N, dk in wood:
        fns = {"woodbury": lambda *a: joint_write(*a, woodbury=True), "dk": lambda *a: joint_write(*a, woodbury=False)}
        res = fwd_and_fwdbwd(fns, make_frame(32, N, dk, dk, device), device, args)
        x = {p: ratio(res[p][1], "dk", "woodbury") for p in res}
        raw.append({"N": N, "dk": dk, "P": 32, "median_s": {p: res[p][0] for p in res}, "dk_over_woodbury": x})
        rows.append([N, dk, 32, ms(res["fwd"][0]["woodbury"]), ms(res["fwd"][0]["dk"]), f"{x['fwd']:.2f}",
                     ms(res["fwdbwd"][0]["woodbury"]), ms(res["fwdbwd"][0]["dk"]), f"{x['fwdbwd']:.2f}"])
    rep.data["part1_woodbury"] = raw
    rep.section(
        "Part 1b: N x N (Woodbury) vs dk x dk system for N < dk (x = dk-path time / Woodbury time)",
        ["N", "dk=dv", "P", "Woodbury fwd ms", "dk fwd ms", "fwd x", "Woodbury fwd+bwd ms", "dk fwd+bwd ms", "fwd+bwd x"],
        rows,
    )


# ----------------------------------------------------------------------------------------------------------
# Part 2: DRAMLayer.forward over a window against a loop of step
# ----------------------------------------------------------------------------------------------------------


def part2(args, device, rep):
    # DiT-host-like shared-source layer: ViT-S width 384 = 6 heads x 64, N = M = 129 tokens per frame
    cfg = DRAMConfig(d_q=384, d_k=384, d_v=384, n_heads=6, head_dk=64, head_dv=64)
    B, N = 4, 129
    Ts = (8, 16) if args.quick else (8, 16, 32)
    layer = DRAMLayer(cfg).to(device)
    with torch.no_grad():  # a trained-looking layer: non-zero f_O so the readout reaches y and its gradient flows
        layer.f_O.weight.normal_(0, 0.02)
    params = list(layer.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, raw = [], []
    for T in Ts:
        x = torch.randn(B, T, N, cfg.d_q, generator=g).to(device)  # [B, T, N, D]
        S0 = torch.randn(B, cfg.n_heads, cfg.head_dk, cfg.head_dv, generator=g).to(device)  # [B, H, dk, dv]
        gy = torch.randn(B, T, N, cfg.d_q, generator=g).to(device)  # dL/dy
        gS = torch.randn_like(S0)  # dL/dS_T (what the next window would send back)

        def window():
            y, _, S = layer(x, x, x, S0)  # y [B, T, N, D], S [B, H, dk, dv]
            return y, S

        def loop():
            S, ys = S0, []
            for t in range(T):
                y, _, S = layer.step(x[:, t], x[:, t], x[:, t], S)  # y [B, N, D]
                ys.append(y)
            return torch.stack(ys, 1), S  # [B, T, N, D]

        def fb(fn):
            def run():
                y, S = fn()
                return torch.autograd.grad((y * gy).sum() + (S * gS).sum(), params)

            return run

        def fwd(fn):
            def run():
                with torch.no_grad():
                    return fn()

            return run

        rf = compare({"window": fwd(window), "loop": fwd(loop)}, device, args.min_run_time, args.rounds)
        rb = compare({"window": fb(window), "loop": fb(loop)}, device, args.min_run_time, args.rounds)
        if args.profile and T == 16:  # the target's case
            profile_ops({"window": fwd(window), "loop": fwd(loop)}, device, rep,
                        f"Profile of the layer's forward over T = {T} frames")
        xf, xb = ratio(rf[1], "loop", "window"), ratio(rb[1], "loop", "window")
        raw.append({"T": T, "B": B, "N": N, "median_s_fwd": rf[0], "median_s_fwdbwd": rb[0],
                    "loop_over_window": {"fwd": xf, "fwdbwd": xb}})
        tw_b = rb[0]["window"]
        rows.append([T, ms(rf[0]["window"]), ms(rf[0]["loop"]), f"{xf:.2f}", ms(tw_b), ms(rb[0]["loop"]),
                     f"{xb:.2f}", f"{B * T / tw_b:.0f}"])
    rep.data["part2_window"] = raw
    rep.section(
        "Part 2: DRAMLayer.forward over a window vs a loop of step (x = loop time / window time)",
        ["T", "window fwd ms", "loop fwd ms", "fwd x", "window fwd+bwd ms", "loop fwd+bwd ms", "fwd+bwd x",
         "window frames/s (fwd+bwd)"],
        rows,
        note=f"One layer, d = 384, H = 6, dk = dv = 64, B = {B}, N = M = {N} (shared source, DiT-host-like). "
        f"fwd+bwd = gradients of all parameters for <y, g_y> + <S_T, g_S>.",
    )
    r16 = next(r for r in raw if r["T"] == 16)
    rep.target("window forward vs step loop, T=16", r16["loop_over_window"]["fwd"], 2.0)


# ----------------------------------------------------------------------------------------------------------
# Shared by parts 3-4: the DiT host at its two real sizes
# ----------------------------------------------------------------------------------------------------------

# vision tower, its input size (= the suite's camera resolution) and what it yields per frame:
#   libero:   vit_small_patch16_224.dino at 128 px -> 2 cameras x 64 patches + 1 instruction token = 129 x 384
#   embedded: vit_tiny_patch16_224 at 64 px        -> 2 cameras x 16 patches + 1 instruction token =  33 x 192
HOST_SIZES = {
    "libero": dict(vision="vit_small_patch16_224.dino", image_size=128, chunk=LIBERO_CHUNK),
    "embedded": dict(vision="vit_tiny_patch16_224", image_size=64),
    # the DiT action head at the size of GR00T N1.5's (Isaac-GR00T FlowmatchingActionHead: 16 blocks alternating
    # cross / self attention, 32 heads x 48 = width 1536, cross-attention to tokens of width 2048, action horizon
    # 16, 4 Euler steps), memory with dk = dv = 64. The tokens stand in for GR00T's vision-language features:
    # 2 cameras x 196 tokens x 2048 (a frozen ResNet-50 at 448 px has that output; N = 392 as in the grid)
    "gr00t": dict(vision="resnet50", image_size=448, d_model=1536, head_blocks=16, head_heads=32, chunk=16,
                  flow_steps=4, mem_dk=64, mem_dv=64),
}


STAND_IN_ENCODER = {"gr00t"}  # its tower only gives the tokens' shape: no targets that include the encoder's time


def host_sizes(args, device):
    """--sizes, or by default all sizes on a GPU and the two small ones on the CPU (at the gr00t size one CPU
    training step of 8 x 16 frames takes minutes)."""
    if args.sizes:
        return [s for s in args.sizes.split(",") if s]
    return list(HOST_SIZES) if device.type == "cuda" else ["libero", "embedded"]


def make_dit(size, memory, device):
    """The DiT host in the host's default configuration (mem depth 2 as train.py uses on LIBERO, 4 heads, dk = dv = 32,
    head width 128, 4 blocks; action chunk 10 at the libero size, 4 at the embedded one; the gr00t size overrides the
    head's and memory's sizes), random tower weights (timing does not depend on them). A trained-looking memory:
    f_O is zero at initialisation (exact identity), here small random so that reads reach the head and gradients
    flow."""
    cfg = HostConfig(**(dict(memory=memory, chunk=DEFAULTS["chunk"], vocab=("bench instruction",), pretrained=False)
                        | HOST_SIZES[size]))
    host = make_host("dit", cfg).to(device)
    if host.memory is not None:
        with torch.no_grad():
            for layer in host.memory.layers:
                layer.f_O.weight.normal_(0, 0.02)
    return host


def tokens_per_frame(host):
    """n_cam * P patch tokens of one frame (a probe through the frozen tower at the configured size)."""
    s = host.cfg.image_size
    img = {c: torch.zeros(1, s, s, 3, dtype=torch.uint8) for c in host.cfg.cameras}
    with torch.no_grad():
        return host.encode(img).shape[1]


def random_images(host, n, device, g):
    """n frames of uint8 camera images at the suite's resolution: dict cam -> [n, s, s, 3]."""
    s = host.cfg.image_size
    return {c: torch.randint(0, 256, (n, s, s, 3), generator=g, dtype=torch.uint8).to(device) for c in host.cfg.cameras}


# ----------------------------------------------------------------------------------------------------------
# Part 3: deployment latency, DRAM at episode step t against a k-frame context on the same DiT head
# ----------------------------------------------------------------------------------------------------------


class KFrameContext(nn.Module):
    """The multi-frame baseline (paper, introduction): no memory; the DiT head cross-attends to the concatenated
    tokens of the last k frames. A ring buffer holds the k most recent frames' encoded patch tokens (the frozen
    tower runs once per frame, as for DRAM); a learned per-slot frame embedding, indexed by the frame's AGE
    (0 = current), lets the head tell the frames apart; the instruction token is appended once.

    Built on a memory="none" DiT host, so the head (hosts.DiTHead), camera and instruction embeddings are the
    same modules that the DRAM host uses; only the conditioning tokens differ: k n_cam P + 1 instead of n_cam P + 1."""

    def __init__(self, host, k):
        super().__init__()
        assert host.memory is None, "the k-frame baseline runs on the memoryless host"
        self.host, self.k = host, k
        self.frame_embed = nn.Parameter(0.02 * torch.randn(k, 1, host.tower.width))  # [k, 1, D] per age

    def init_buffer(self, B, NP, device):
        """The persistent state of this policy: [B, k, n_cam P, D] encoded tokens of the last k frames."""
        return torch.zeros(B, self.k, NP, self.host.tower.width, device=device)

    def step(self, feats, instr, buf, t):
        """Control step t (0-based): write frame t into slot t mod k (in place), then build the head's tokens.
        feats [B, n_cam P, D] -> {"tokens": [B, k n_cam P + 1, D]}. Assumes t >= k - 1 (buffer full); before
        that the empty slots would be masked, which only makes the early steps cheaper."""
        B, NP, D = feats.shape
        n_cam = len(self.host.cfg.cameras)
        slot = t % self.k
        buf[:, slot] = feats  # ring buffer write
        age = (slot - torch.arange(self.k, device=feats.device)) % self.k  # [k] age of the frame in each slot
        x = buf.view(B, self.k, n_cam, NP // n_cam, D) + self.host.cam_embed + self.host.patch_pos  # [B,k,n_cam,P,D]
        x = x.reshape(B, self.k, NP, D) + self.frame_embed[age]  # [B, k, NP, D] + [k, 1, D]
        lang = self.host.instr_embed(instr)[:, None]  # [B, 1, D]
        return {"tokens": torch.cat([x.reshape(B, self.k * NP, D), lang], 1)}  # [B, k NP + 1, D]


def part3(args, device, rep):
    graphed = device.type == "cuda"  # also replay every policy step as a CUDA graph
    B = 1  # one robot: the latency of one control step
    ts = (10, 100, 1000)
    ks = (1, 4, 8, 16)
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, raw = [], {}
    sizes = host_sizes(args, device)
    for size in sizes:
        torch.manual_seed(0)
        host = make_dit(size, "dram", device).eval()
        base = make_dit(size, "none", device).eval()
        NP, D = tokens_per_frame(host), host.tower.width
        instr = torch.zeros(B, dtype=torch.long, device=device)
        svec = torch.randn(B, host.cfg.state_dim, generator=g).to(device)  # proprioceptive state [B, Ds]
        noise = torch.randn(B, host.cfg.chunk, host.cfg.action_dim, generator=g).to(device)  # fixed draw [B, C, Da]
        images = random_images(host, B, device, g)
        pool = torch.randn(16, B, NP, D, generator=g).to(device)  # frames fed while advancing the memory
        feats = torch.randn(B, NP, D, generator=g).to(device)  # the frame of the timed step [B, NP, D]

        # DRAM: advance the memory t steps (real transitions), keep S_t, then time step t+1 from S_t
        states, S = {}, host.init_state(B, device)
        with torch.no_grad():
            for t in range(1, max(ts) + 1):
                _, S = host.step(pool[t % len(pool)], instr, S)
                if t in ts:
                    states[t] = S.clone()

        def dram_step(S_t):
            def run():  # one control step: one read-write transition + one action chunk (flow_steps Euler steps)
                with torch.no_grad():
                    ctx, _ = host.step(feats, instr, S_t)
                    return host.sample(ctx, svec, instr, noise)

            return run

        ctxs = {k: KFrameContext(base, k).to(device).eval() for k in ks}
        bufs = {k: ctxs[k].init_buffer(B, NP, device).copy_(torch.randn(B, k, NP, D, generator=g)) for k in ks}

        def ctx_step(k):
            def run():  # timed at a full buffer (t = 2k - 1 >= k - 1)
                with torch.no_grad():
                    ctx = ctxs[k].step(feats, instr, bufs[k], 2 * k - 1)
                    return base.sample(ctx, svec, instr, noise)

            return run

        def encode():
            with torch.no_grad():
                return host.encode(images)

        fns = {f"dram t={t}": dram_step(states[t]) for t in ts}
        fns.update({f"k={k}": ctx_step(k) for k in ks})
        fns["encode"] = encode
        med, per = compare(fns, device, args.min_run_time, args.rounds)
        if args.profile:  # the k = 8 target's two candidates
            profile_ops({k: fns[k] for k in ("dram t=10", "k=8")}, device, rep,
                        f"Profile of a control step, {size} size (policy step, excl. encoder)")
        enc = per["encode"]
        ref = "dram t=10"
        # the t = 1000 target compares identical computations to within 5 %, finer than one block per round resolves
        # on a machine whose speed drifts by 10-20 % within seconds: the DRAM steps alone get a timing of their own,
        # with 6x the rounds of shorter blocks (skipped where one step takes seconds: the gr00t size on a CPU)
        dram_med, dram_per = med, per
        if med[ref] < 0.25:
            dram_med, dram_per = compare({f"dram t={t}": fns[f"dram t={t}"] for t in ts}, device,
                                         3 * args.min_run_time, 6 * args.rounds)
        if graphed:  # the same steps replayed as CUDA graphs (as eval.py deploys them on a GPU)
            gmed, gper = compare({k: capture_cuda_graph(f)[0].replay for k, f in fns.items()}, device,
                                 args.min_run_time, args.rounds)
        state_bytes = states[ts[0]][0].numel() * states[ts[0]].element_size()  # one stream, fp32
        out = {"tokens_per_frame": NP + 1, "width": D, "median_s": med, "rows": {}}
        for name in fns:
            if name == "encode":
                continue
            dram = name.startswith("dram")
            m, p = (dram_med, dram_per) if dram else (med, per)  # the DRAM rows from their own timing
            x = ratio(p, name, ref)  # time / time(DRAM at t = 10), policy step only
            if dram:  # incl. encoder: the encoder's median added to both
                tot = (m[name] + med["encode"]) / (m[ref] + med["encode"])
            else:
                tot = statistics.median((a + e) / (b + e) for a, b, e in zip(per[name], per[ref], enc))
            nbytes = state_bytes if dram else bufs[int(name[2:])][0].numel() * 4
            ntok = NP + 1 if dram else int(name[2:]) * NP + 1
            out["rows"][name] = {"step_s": m[name], "x_vs_dram_t10": x, "x_vs_dram_t10_incl_encoder": tot,
                                 "persistent_bytes": nbytes, "head_tokens": ntok}
            rows.append([size, name, ntok, ms(m[name]), f"{x:.2f}", ms(m[name] + med["encode"]), f"{tot:.2f}",
                         f"{nbytes / 1024:.0f} KiB"])
            if graphed:
                gx = ratio(gper, name, ref)
                out["rows"][name].update(graph_step_s=gmed[name], graph_x_vs_dram_t10=gx)
                rows[-1][-1:-1] = [ms(gmed[name]), f"{gx:.2f}"]
        if graphed:
            out["graph_encode_s"] = gmed["encode"]
        out["encode_s"] = med["encode"]
        raw[size] = out
        del host, base, ctxs, bufs
    rep.data["part3_deployment"] = raw
    rep.section(
        "Part 3: per-control-step latency, DRAM at episode step t vs a k-frame context (x = time / DRAM t=10 time)",
        ["host size", "policy", "head tokens", "step ms (excl. encoder)", "x", "step ms incl. encoder", "x incl. encoder"]
        + (["CUDA graph step ms", "x (graphs)"] if graphed else []) + ["persistent memory / stream"],
        rows,
        note=f"B = 1. One control step = host.step (DRAM: one read-write transition of the 2-layer stack) or the ring "
        f"buffer write + token assembly (k-frame), then host.sample (one action chunk: {HostConfig.flow_steps} Euler "
        f"steps of the same hosts.DiTHead; 4 at the gr00t size, as GR00T). The frozen encoder (2 cameras, uint8 -> "
        f"tokens) is identical for both and timed separately: "
        + ", ".join(f"{s} {ms(raw[s]['encode_s'])} ms" for s in sizes) + "; "
        f"'incl. encoder' adds it (at the gr00t size a ResNet-50 stands in for GR00T's vision-language model: "
        f"shape only, no target). The DRAM rows come from a separate interleaved timing of the three DRAM steps "
        f"alone (6x the rounds, 3x the time; not for the gr00t size on a CPU); the k rows' x is against DRAM t=10 "
        f"in the timing of all policies. DRAM state: fp32 [L, H, dk, dv]; "
        f"k-frame: fp32 [k, n_cam P, D] tokens."
        + (" CUDA graph: the same policy step captured as one graph and timed by replays (eval.py deploys it so on "
           "a GPU); encoder as a graph: " + ", ".join(f"{s} {ms(raw[s]['graph_encode_s'])} ms" for s in sizes)
           + "." if graphed else ""),
    )
    for size in sizes:
        r = raw[size]["rows"]
        rep.target(f"{size}: step latency t=1000 vs t=10 (policy step)", r["dram t=1000"]["x_vs_dram_t10"], 0.05,
                   kind="within")
        rep.target(f"{size}: k=8 context vs DRAM per step (policy step, excl. encoder)", r["k=8"]["x_vs_dram_t10"], 3.0)
        if size not in STAND_IN_ENCODER:
            rep.target(f"{size}: k=8 context vs DRAM per step (incl. frozen encoder)",
                       r["k=8"]["x_vs_dram_t10_incl_encoder"], 3.0)
        if graphed:
            rep.target(f"{size}: k=8 context vs DRAM per step, both CUDA graphs (policy step)",
                       r["k=8"]["graph_x_vs_dram_t10"], 3.0)


# ----------------------------------------------------------------------------------------------------------
# Part 4: training throughput and activation memory
# ----------------------------------------------------------------------------------------------------------


def make_train_step(host, opt, B, T, device, g, images=None, graphs=False):
    """One TBPTT training step as train.py runs it (train.train_step: host.loss over a window, bf16 autocast on
    CUDA, mean over valid frames, backward, clip, AdamW). Reads cached features [B, T, NP, D], or with `images`
    (dict cam -> uint8 [B T, s, s, 3]) encodes them inside the step with the frozen tower (the no-cache path).
    graphs: the step as train.py --cuda-graphs runs it (train.GraphedTrainStep; opt from adamw(capturable=True))."""
    cfg = host.cfg
    NP = tokens_per_frame(host)
    batch = dict(
        tokens=torch.randn(B, T, NP, host.tower.width, generator=g).to(device),  # [B, T, NP, D]
        instr=torch.zeros(B, dtype=torch.long, device=device),
        state=torch.randn(B, T, cfg.state_dim, generator=g).to(device),  # [B, T, Ds]
        actions=torch.randn(B, T, cfg.chunk, cfg.action_dim, generator=g).to(device),  # [B, T, C, Da]
        action_mask=torch.ones(B, T, cfg.chunk, dtype=torch.bool, device=device),  # [B, T, C]
        frame_valid=torch.ones(B, T, dtype=torch.bool, device=device),  # [B, T]
        reset=torch.zeros(B, dtype=torch.bool, device=device),  # [B]
    )
    S0 = host.init_state(B, device)
    if S0.numel():
        S0 = 0.1 * torch.randn(S0.shape, generator=g).to(device)  # a carried-over (detached) state
    params = host.trainable_parameters()
    if graphs:
        graphed = GraphedTrainStep(host, opt, params, batch, S0, 1.0)
        return lambda: graphed(batch)

    def step():
        b = batch if images is None else dict(batch, tokens=host.encode(images).view(B, T, NP, -1))  # [B, T, NP, D]
        train_step(host, opt, params, b, S0, 1.0)

    return step


def adamw(host, capturable=False):
    """train.py's optimizer at train.py's defaults (train.make_optimizer: AdamW in four groups, weight decay on the
    weight matrices, the memory at --mem-lr-mult); capturable: its step count and lr on the device (--cuda-graphs)."""
    p = parser()
    return make_optimizer(host, DEFAULTS["lr"], p.get_default("weight_decay"), p.get_default("mem_lr_mult"),
                          capturable)


def saved_tensor_bytes(fn, params):
    """Bytes of the distinct tensors autograd saves for backward while fn() runs (parameters excluded): the
    activation memory of a training step, device-independent. Distinct = by storage (views share one)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in skip:
            seen[(s.data_ptr(), x.device)] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return sum(seen.values()), out


def part4(args, device, rep):
    Bm = 2 if args.quick and device.type == "cpu" else 8  # batch of the activation-memory table
    Ts = (4, 8, 16, 32)
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, mrows, raw = [], [], {}
    sizes = host_sizes(args, device)
    for size in sizes:
        # B = 8 streams x T = 16 frames; the gr00t size on the CPU takes a window of 1 x 4 (seconds per step; the
        # ratios are per frame, and both the memory's and the head's cost are linear in the frames there) and skips
        # the activation-memory table (B = 8, T = 32 would take minutes per step)
        cpu_gr00t = size == "gr00t" and device.type == "cpu"
        B, T = (1, 4) if cpu_gr00t else (8, 16)
        torch.manual_seed(0)
        dram_host, none_host = make_dit(size, "dram", device).train(), make_dit(size, "none", device).train()
        opt = adamw(dram_host)  # one optimizer per host and step kind (AdamW's state is twice the weights)
        steps = {"dram": make_train_step(dram_host, opt, B, T, device, g),
                 "none": make_train_step(none_host, adamw(none_host), B, T, device, g)}
        if device.type == "cuda":  # the same steps as CUDA graph replays (train.py --cuda-graphs)
            steps |= {f"{k} graph": make_train_step(h, adamw(h, capturable=True), B, T, device, g, graphs=True)
                      for k, h in (("dram", dram_host), ("none", none_host))}
        med, per = compare(steps, device, args.min_run_time, args.rounds)
        overhead = ratio(per, "dram", "none")  # DRAM step time / memoryless step time (same frames per step)
        if args.profile:
            profile_ops({k: steps[k] for k in ("dram", "none")}, device, rep,
                        f"Profile of a training step, {size} size (B = {B}, T = {T})", calls=3)

        # on the fly: host.encode inside the step. A CPU --quick run times the tower on a slice of the window's
        # frames and scales it linearly (the tower is batch-linear), since the full LIBERO window takes ~10 s
        n_enc = B * T if not (args.quick and device.type == "cpu") else min(B * T, 2 * (2 if size == "libero" else 8))
        imgs = random_images(dram_host, n_enc, device, g)
        otf = enc = None
        if size in STAND_IN_ENCODER:
            cache_x = t_otf = None
            how = "not measured: stand-in encoder"
        elif n_enc == B * T:
            otf = make_train_step(dram_host, opt, B, T, device, g, images=imgs)
            _, p2 = compare({"cache": steps["dram"], "otf": otf}, device, args.min_run_time, rounds=3, warmup=1)
            cache_x = ratio(p2, "otf", "cache")
            how = "encode inside the step"
        else:
            def enc():
                with torch.no_grad():
                    return dram_host.encode(imgs)

            _, p2 = compare({"cache": steps["dram"], "enc": enc}, device, args.min_run_time, rounds=3, warmup=1)
            scale = B * T / n_enc
            cache_x = statistics.median((c + scale * e) / c for c, e in zip(p2["cache"], p2["enc"]))
            how = f"encode timed on {n_enc} of {B * T} frames, scaled x{scale:g}"
        if cache_x is not None:  # the row's two frames/s columns agree with its ratio: cached step x cache_x
            t_otf = med["dram"] * cache_x
        fps = {k: B * T / v for k, v in med.items()}
        raw[size] = {"B": B, "T": T, "median_s": med, "frames_per_s": fps, "dram_over_none": overhead,
                     "onthefly_s": t_otf, "onthefly_over_cache": cache_x, "onthefly_how": how}
        rows.append([size, f"{B} x {T}", f"{fps['dram']:.1f}", f"{fps['none']:.1f}", f"{overhead:.2f}",
                     "-" if t_otf is None else f"{B * T / t_otf:.1f}", "-" if cache_x is None else f"{cache_x:.1f}", how])
        if device.type == "cuda":
            raw[size]["graph_dram_over_none"] = ratio(per, "dram graph", "none graph")
            raw[size]["graph_speedup"] = {k: ratio(per, k, f"{k} graph") for k in ("dram", "none")}
            rows[-1] += [f"{fps['dram graph']:.0f}", f"{fps['none graph']:.0f}",
                         f"{raw[size]['graph_dram_over_none']:.2f}"]
        # the timed steps' optimizer states, gradients and CUDA graph pools are freed before the memory table (at
        # the gr00t size they hold tens of GB)
        steps = opt = otf = enc = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

        # activation memory against the window length T (linear in B: a --quick CPU run uses B = 2)
        mem = []
        for Tw in Ts if not cpu_gr00t else ():
            entry = {"T": Tw}
            for name, h in (("dram", dram_host), ("none", none_host)):
                fn = make_train_step(h, adamw(h), Bm, Tw, device, g)
                params = h.trainable_parameters() + list(h.tower.parameters())
                if device.type == "cuda":
                    fn()  # warm-up: optimizer state allocated, then measure the peak above what is resident
                    torch.cuda.synchronize(device)
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    fn()
                    torch.cuda.synchronize(device)
                    entry[f"{name}_cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
                nbytes, _ = saved_tensor_bytes(fn, params)
                entry[f"{name}_saved_bytes"] = nbytes
            mem.append(entry)
            mib = lambda b: f"{b / 2**20:.1f}"
            r = [size, Tw, mib(entry["dram_saved_bytes"]), mib(entry["none_saved_bytes"]),
                 mib(entry["dram_saved_bytes"] / (Bm * Tw))]
            if device.type == "cuda":
                r += [mib(entry["dram_cuda_peak_bytes"]), mib(entry["none_cuda_peak_bytes"])]
            mrows.append(r)
        raw[size]["memory_vs_T"] = mem
        del dram_host, none_host  # before the next size's hosts are built
    rep.data["part4_training"] = raw
    rep.section(
        "Part 4a: training step frames/s (host.loss + backward + clip + AdamW over B streams x T frames)",
        ["host size", "B x T", "DRAM frames/s (cache)", "none frames/s (cache)", "DRAM time / none time",
         "DRAM frames/s on the fly", "cache x vs on the fly", "on-the-fly timing"]
        + (["DRAM frames/s (CUDA graph)", "none frames/s (CUDA graph)", "DRAM / none (CUDA graphs)"]
           if device.type == "cuda" else []),
        rows,
        note="Both read cached features (random tensors of the tower's output shape); 'on the fly' encodes uint8 "
        "images of the suite's resolution (2 cameras) with the frozen tower inside the step (not at the gr00t size, "
        "whose ResNet-50 tower only stands in for the shape of GR00T's vision-language features). 'cache x' comes "
        "from its own interleaved timing of the cached and the on-the-fly step; the on-the-fly frames/s are the "
        "cached frames/s divided by it."
        + (" bf16 autocast as in train.py. CUDA graph: the step captured as one graph (train.py --cuda-graphs: "
           "train.GraphedTrainStep, capturable AdamW) and timed by replays." if device.type == "cuda" else ""),
    )
    head = ["host size", "T", "DRAM saved MiB", "none saved MiB", "DRAM saved MiB / frame"]
    if device.type == "cuda":
        head += ["DRAM CUDA peak MiB", "none CUDA peak MiB"]
    if mrows:
        rep.section(
            f"Part 4b: activation memory of a training step vs TBPTT window T (B = {Bm})",
            head,
            mrows,
            note="saved = bytes of the distinct tensors autograd saves for backward (torch.autograd.graph."
            "saved_tensors_hooks; parameters excluded, the input window included); tracemalloc does not see torch's "
            "allocator." + (" CUDA peak = torch.cuda.max_memory_allocated during a step minus what was resident "
                            "before it (weights, AdamW state, inputs)." if device.type == "cuda" else "")
            + (" Not at the gr00t size on the CPU." if "gr00t" in sizes and device.type == "cpu" else ""),
        )
    for size in sizes:
        rep.target(f"{size}: DRAM training time per frame vs memory=none", raw[size]["dram_over_none"], 1.3, kind="<=")
        if device.type == "cuda":
            rep.target(f"{size}: DRAM training time per frame vs memory=none, both CUDA graphs",
                       raw[size]["graph_dram_over_none"], 1.3, kind="<=")
        if size not in STAND_IN_ENCODER:
            rep.target(f"{size}: feature cache vs on-the-fly encoding, frames/s", raw[size]["onthefly_over_cache"], 10.0)


PARTS = {1: part1, 2: part2, 3: part3, 4: part4}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="smaller grid, shorter timings (< 2 min on 2 CPU cores)")
    p.add_argument("--parts", default=",".join(str(k) for k in PARTS), help="comma-separated, e.g. 1,2")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json (a trailing .md/.json is stripped)")
    p.add_argument("--min-run-time", type=float, default=None, help="seconds of timing per comparison")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per comparison")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--sizes", default=None, help="host sizes of parts 3-4, comma-separated, from "
                   f"{','.join(HOST_SIZES)} (default: all on CUDA, libero,embedded on the CPU)")
    p.add_argument("--profile", action="store_true", help="also profile (torch.profiler, top ops by self time) the "
                   "joint write and its autograd baselines at N = 129 (part 1), the window and the step loop at "
                   "T = 16 (part 2), the DRAM and k = 8 control steps (part 3) and the training steps (part 4)")
    args = p.parse_args(argv)
    try:
        parts = sorted({int(s) for s in args.parts.split(",") if s.strip()})
    except ValueError:
        p.error(f"--parts: expected comma-separated integers, got {args.parts!r}")
    for k in parts:
        if k not in PARTS:
            p.error(f"--parts: no part {k}; parts are {sorted(PARTS)}")
    for s in (args.sizes or "").split(","):
        if s and s not in HOST_SIZES:
            p.error(f"--sizes: no host size {s!r}; sizes are {list(HOST_SIZES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    for k in ("min_run_time", "rounds", "threads"):
        if getattr(args, k) is not None and not getattr(args, k) > 0:
            p.error(f"--{k.replace('_', '-')} must be > 0, got {getattr(args, k)}")
    given = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("min_run_time", "rounds") if getattr(args, k)]
    if args.min_run_time is None:
        args.min_run_time = 0.3 if args.quick else 1.0
    if args.rounds is None:
        args.rounds = 5 if args.quick else 7
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    rep = Report(machine(device))
    print(rep.markdown(), flush=True)
    t0 = time.perf_counter()
    for k in parts:
        PARTS[k](args, device, rep)
    rep.info["wall_s"] = round(time.perf_counter() - t0, 1)
    rep.info["command"] = "python bench.py " + " ".join(
        a for a in ["--quick" if args.quick else "", f"--device {args.device}", f"--parts {args.parts}",
                    f"--threads {args.threads}" if args.threads else "", f"--sizes {args.sizes}" if args.sizes else "",
                    "--profile" if args.profile else ""]
        + given if a
    )
    print(f"\ndone in {rep.info['wall_s']} s")
    if args.out:
        base = args.out[:-3] if args.out.endswith(".md") else args.out[:-5] if args.out.endswith(".json") else args.out
        with open(base + ".md", "w") as f:
            f.write(rep.markdown())
        with open(base + ".json", "w") as f:
            json.dump({"machine": rep.info, "targets": rep.targets, **rep.data}, f, indent=1)
        print(f"wrote {base}.md, {base}.json")


if __name__ == "__main__":
    main()

"""
Speed and memory of DRAM against its alternatives, measured side by side in ONE run (issue 6).

Every figure is a ratio against a baseline timed in the same process, so it holds on a noisy machine. Timings are
medians of torch.utils.benchmark.Timer.blocked_autorange after a warm-up (the Timer synchronises CUDA itself).

  python bench.py --quick                       # parts 1-2, < 2 min on 2 CPU cores
  python bench.py                               # full grid, < 10 min on 2 CPU cores
  python bench.py --device cuda --out results   # writes results.md and results.json

Parts (sizes from the hosts' configurations: N in {64, 128, 392, 800} write tokens plus the DiT host's 129 / 257,
dk = dv in {64, 128}, batch x heads P from 8 to 256):
  1  joint_write forward / forward+backward against autograd through torch.linalg.solve, autograd through
     torch.linalg.cholesky + cholesky_solve and the token-by-token sequential_delta_write; the N x N (Woodbury)
     path against the dk x dk path for N < dk; achieved GFLOP/s against dense matmul GFLOP/s of the same run.
  2  DRAMLayer.forward over a TBPTT window of T in {8, 16, 32} frames against a loop of DRAMLayer.step.
  3  deployment latency of the DiT host (DRAM at episode step t vs a k-frame context baseline)  -- needs hosts.py
  4  training frames/s (DRAM vs --memory none, feature cache vs on-the-fly), peak memory vs T   -- needs hosts.py
"""
import argparse
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark

import dram
from dram import DRAMConfig, DRAMLayer, joint_write, sequential_delta_write, write_weights

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

    def target(self, name, measured, threshold):
        """A target 'measured >= threshold' (both ratios of times taken in this run)."""
        ok = measured >= threshold
        self.targets.append({"target": name, "measured": measured, "threshold": threshold, "pass": ok})
        print(f"{'PASS' if ok else 'MISS'}  {name}: {measured:.2f}x (target >= {threshold:g}x)", flush=True)

    def markdown(self):
        head = ["## DRAM benchmark", ""]
        head += [f"- {k}: {v}" for k, v in self.info.items()]
        head.append("")
        out = "\n".join(head) + "\n" + "\n".join(self.md)
        if self.targets:
            out += "\n### Targets\n\n| target | measured | target | result |\n|---|---|---|---|\n"
            out += "".join(
                f"| {t['target']} | {t['measured']:.2f}x | >= {t['threshold']:g}x | {'PASS' if t['pass'] else 'MISS'} |\n"
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


def write_sequential(S, K, V, w, gamma):
    """(c) the token-by-token gated delta rule with the strength b = w / (1 + w) that the odds form maps back to."""
    return sequential_delta_write(S, K, V, w / (1.0 + w), gamma)


def joint_write_flops(P, N, dk, dv, woodbury):
    """Matmul + factorisation flops of ONE forward joint write as dram.py implements it (elementwise ops omitted;
    full GEMMs counted where a SYRK could halve them, because that is what runs):
      dk path:  G = (WK)^T K 2N dk^2, U = (WK)^T V 2N dk dv, Cholesky dk^3/3, G S_bar 2 dk^2 dv,
                cholesky_solve (two triangular solves) 2 dk^2 dv
      N path:   B = K~ K~^T 2N^2 dk, Cholesky N^3/3, K S_bar 2N dk dv, cholesky_solve 2N^2 dv, K~^T (.) 2N dk dv
    The appendix's O(N dk^2 + N dk dv + dk^3 + dk^2 dv) per head is the dk-path count."""
    if woodbury:
        f = 2 * N * N * dk + N**3 / 3 + 2 * N * dk * dv + 2 * N * N * dv + 2 * N * dk * dv
    else:
        f = 2 * N * dk * dk + 2 * N * dk * dv + dk**3 / 3 + 2 * dk * dk * dv + 2 * dk * dk * dv
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


def fwd_and_fwdbwd(fns, inputs, device, args):
    """Interleaved timings of every fn(*inputs) in `fns` {name: fn}: forward (no_grad) and forward+backward, where
    the backward returns the gradients of all inputs (torch.autograd.grad: nothing accumulates between calls).
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

    return {
        "fwd": compare({k: fwd(f) for k, f in fns.items()}, device, args.min_run_time, args.rounds),
        "fwdbwd": compare({k: fb(f) for k, f in fns.items()}, device, args.min_run_time, args.rounds),
    }


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
        res = fwd_and_fwdbwd(fns, make_frame(P, N, dk, dv, device), device, args)
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
# Parts 3-4 (need hosts.py): implemented parts register here, the others say why they are missing
# ----------------------------------------------------------------------------------------------------------

PARTS = {1: part1, 2: part2}
NOT_YET = {
    3: "deployment latency of the DiT host with DRAM vs a k-frame context baseline (needs hosts.py)",
    4: "training frames/s DRAM vs --memory none, feature cache vs on-the-fly, peak memory vs T (needs hosts.py)",
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="smaller grid, shorter timings (< 2 min on 2 CPU cores)")
    p.add_argument("--parts", default=",".join(str(k) for k in PARTS), help="comma-separated, e.g. 1,2")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json (a trailing .md/.json is stripped)")
    p.add_argument("--min-run-time", type=float, default=None, help="seconds of timing per comparison")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per comparison")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = p.parse_args()
    try:
        parts = sorted({int(s) for s in args.parts.split(",") if s.strip()})
    except ValueError:
        p.error(f"--parts: expected comma-separated integers, got {args.parts!r}")
    for k in parts:
        if k in NOT_YET:
            p.error(f"--parts: part {k} is not implemented yet: {NOT_YET[k]}")
        if k not in PARTS:
            p.error(f"--parts: no part {k}; parts are {sorted(PARTS)} (+ {sorted(NOT_YET)} not implemented yet)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.min_run_time is None:
        args.min_run_time = 0.3 if args.quick else 1.0
    if args.rounds is None:
        args.rounds = 5 if args.quick else 7
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    rep = Report(machine(device))
    print(rep.markdown(), flush=True)
    for k, why in NOT_YET.items():
        print(f"part {k}: not implemented yet: {why}")
    t0 = time.perf_counter()
    for k in parts:
        PARTS[k](args, device, rep)
    rep.info["wall_s"] = round(time.perf_counter() - t0, 1)
    rep.info["command"] = "python bench.py " + " ".join(
        a for a in ["--quick" if args.quick else "", f"--device {args.device}", f"--parts {args.parts}"] if a
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

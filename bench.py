"""
What DRAM costs against what a user would run instead, each timed beside its baseline in ONE process.

  python bench.py --out bench_results                 # CPU: the libero size
  python bench.py --device cuda --out bench_results   # GPU: the libero and gr00t sizes
  python bench.py --quick --parts 1                   # a short run of part 1 only

  1  joint_write forward+backward (its custom backward, eqs. app-adjoint and app-grads) against autograd through
     the same solve of (I + K^T W K) Delta = K^T W (V - K S_bar): by torch.linalg.solve (LU), and by
     torch.linalg.cholesky + cholesky_solve. dk = dv = 64, P = batch x heads, N write tokens per frame.
  2  one control step of the DiT host (B = 1): DRAM from its state after t = 1000 frames against t = 1 (the cost of
     a step does not grow with the episode), and a k-frame context (no memory; the head cross-attends to the last
     k frames' tokens; k = 1 is the memoryless host) against DRAM. On CUDA also replayed as CUDA graphs.
  3  a training step as train.py runs it (train.train_step on cached features), per frame: DRAM against memoryless.
  4  train.py's loop, the dit and vla hosts: the next batch gathered on the main thread (fd.batch) against
     data.Prefetch; the share of the step the main thread waits for its batch.
Sizes of parts 2-3: libero = train.py's LIBERO host (vit_small at 128 px: 129 tokens x 384; its settings, optimizer
and clip read through train.get_args, random tower weights); gr00t = a head of
GR00T N1.5's size (16 blocks, width 1536) on 393 tokens x 2048. Each ratio is the median of per-round ratios over
interleaved rounds, so a load change on a shared machine hits both sides alike; absolute times are this machine's.
"""
import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
from dram import joint_write, write_weights
from eval import capture_cuda_graph
from hosts import make_host
import train

# ---- Timing and tables -------------------------------------------------------------------------------------------
QUICK, FULL = (0.5, 9), (2.0, 15)  # (s of calls per timed function, interleaved rounds): --quick, the default
LATE = 1000  # part 2: the episode frame whose step is timed against frame 1 (LIBERO episodes: up to 520 steps)


def timeit(fns, args):
    """Times every fn of {name: fn} interleaved: rounds of one block of calls of every fn (the order rotated per
    round), a block lasting about run_time / rounds s. -> {name: [s per call, one per round]}."""
    run_time, rounds = QUICK if args.quick else FULL
    sync = torch.cuda.synchronize if args.device.type == "cuda" else (lambda: None)

    def block(fn, n):  # s per call over n back-to-back calls, the device synchronised at both ends
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n

    names, n = list(fns), {}
    for name in names:
        fns[name]()  # warm-up: first-call allocations and kernel choices
        n[name] = max(1, int(run_time / rounds / max(block(fns[name], 1), 1e-6)))
    per = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per[name].append(block(fns[name], n[name]))
    return per


def ratio(per, num, den):
    """Median over rounds of time(num) / time(den)."""
    return statistics.median(a / b for a, b in zip(per[num], per[den]))


def ms(per, name, div=1):
    """Median time per call (/ div) in ms, as text."""
    x = 1e3 * statistics.median(per[name]) / div
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def table(title, headers, rows, note=""):
    lines = [f"### {title}", ""] + ([note, ""] if note else [])
    lines += ["| " + " | ".join(headers) + " |", "|---" * len(headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def machine(device):
    return (f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}" if device.type == "cuda" else
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")


# ---- Part 1: joint_write against autograd through the same solve -------------------------------------------------
def make_frame(P, N, dk, dv, device, seed=0):
    """One frame's inputs for P = batch x heads: unit keys, write weights as DRAMLayer makes them, gamma in (0.9, 1)."""
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(P, dk, dv, generator=g)
    K = F.normalize(torch.randn(P, N, dk, generator=g), dim=-1)  # [P, N, dk] unit rows
    V = torch.randn(P, N, dv, generator=g)
    w = write_weights(torch.sigmoid(torch.randn(P, N, generator=g)))  # eq. (write-gate), beta in (0, 1)
    return [x.to(device) for x in (S, K, V, w, 0.9 + 0.1 * torch.rand(P, generator=g))]  # ..., gamma [P]


def _system(S, K, V, w, gamma):
    """eq. (correction) in its residual form: A = I + K^T W K [P, dk, dk], rhs = K^T W (V - K S_bar) [P, dk, dv]."""
    S_bar = gamma[:, None, None] * S  # [P, dk, dv]
    Kw = K * w[..., None]  # [P, N, dk]
    A = torch.eye(K.shape[-1], device=K.device, dtype=K.dtype) + Kw.mT @ K
    return S_bar, A, Kw.mT @ (V - K @ S_bar)


def write_autograd_solve(S, K, V, w, gamma):
    """S_bar + Delta, Delta by torch.linalg.solve (LU); autograd differentiates the solve."""
    S_bar, A, rhs = _system(S, K, V, w, gamma)
    return S_bar + torch.linalg.solve(A, rhs)


def write_autograd_cholesky(S, K, V, w, gamma):
    """S_bar + Delta, Delta by torch.linalg.cholesky + cholesky_solve; autograd differentiates both."""
    S_bar, A, rhs = _system(S, K, V, w, gamma)
    return S_bar + torch.cholesky_solve(rhs, torch.linalg.cholesky(A))


def part1(args):
    fns = {"joint_write": joint_write, "solve": write_autograd_solve, "cholesky": write_autograd_cholesky}
    rows, headline = [], []
    for P in (32,) if args.quick else (8, 32, 128):
        for N in (33, 129, 393):  # tokens per frame of the embedded, libero and gr00t hosts
            leaves = [x.requires_grad_(True) for x in make_frame(P, N, 64, 64, args.device)]
            g_out = torch.randn(P, 64, 64, device=args.device)  # a fixed upstream gradient dL/dS_new [P, dk, dv]
            fwd_bwd = {k: lambda f=f: torch.autograd.grad(f(*leaves), leaves, g_out) for k, f in fns.items()}
            per = timeit(fwd_bwd, args)
            x = {k: ratio(per, k, "joint_write") for k in ("solve", "cholesky")}
            rows.append([P, N, ms(per, "joint_write"), ms(per, "solve"), f"{x['solve']:.2f}", ms(per, "cholesky"),
                         f"{x['cholesky']:.2f}"])
            if (P, N) == (32, 129):
                headline += [(f"joint_write fwd+bwd vs autograd {b} (P 32, N 129)", x[k], f"{b} / joint_write")
                             for k, b in (("solve", "linalg.solve"), ("cholesky", "Cholesky"))]
    headers = ["P = B x H", "N", "joint_write ms", "autograd solve ms", "x solve", "autograd Cholesky ms", "x Cholesky"]
    return table("Part 1: joint_write forward+backward vs autograd through the same solve", headers, rows,
                 "dk = dv = 64; the gradients of all five inputs; x = baseline time / joint_write time."), headline


# ---- The DiT host at the sizes of parts 2-3 ----------------------------------------------------------------------
HOST_SIZES = {  # changes to train.py's LIBERO host
    "libero": {},
    # GR00T N1.5's FlowmatchingActionHead: 16 blocks alternating cross / self attention, 32 heads x 48 = 1536,
    # horizon 16, 4 Euler steps; a random ResNet-50 at 448 px stands in for its 2 x 196 vision-language tokens x 2048
    "gr00t": dict(vision="resnet50", image_size=448, d_model=1536, head_blocks=16, head_heads=32, chunk=16,
                  flow_steps=4, mem_dk=64, mem_dv=64),
}


def train_args(host="dit"):
    """train.py's settings for a LIBERO run, random tower weights (the timings do not depend on them)."""
    return train.get_args(["--suite", "libero_10", "--no-pretrained", "--host", host], run_folder=False)


def make_bench_host(size, memory, device, host="dit"):
    """train.py's LIBERO host (action width 7) with HOST_SIZES[size]'s changes; those are the DiT head's, which the vla
    host's expert (part 4) ignores."""
    cfg = train.host_config(train_args(host), vocab=("bench",), action_dim=7)
    return make_host(host, dataclasses.replace(cfg, memory=memory, **HOST_SIZES[size])).to(device)


# ---- Part 2: control-step latency, DRAM at episode step t against a k-frame context ------------------------------
class KFrameContext(nn.Module):
    """The multi-frame baseline (paper, introduction): no memory; the DiT head cross-attends to the last k frames'
    tokens, kept in a ring buffer [B, k, n_cam P, D] (the tower runs once per frame, as for DRAM) and told apart by a
    learned embedding per frame age (0 = current); the instruction token comes once. Built on a memory="none" host,
    whose embeddings and head it uses: at k = 1 with a zero age embedding it conditions the head exactly as that host
    does."""

    def __init__(self, host, k):
        super().__init__()
        assert host.memory is None, "the k-frame baseline runs on the memoryless host"
        self.host, self.k = host, k
        self.frame_embed = nn.Parameter(0.02 * torch.randn(k, 1, host.tower.width))  # [k, 1, D] per age

    def step(self, feats, instr, buf, t):
        """Control step t (0-based): frame t into slot t mod k (in place), then the head's tokens.
        feats [B, n_cam P, D] -> {"tokens": [B, k n_cam P + 1, D]} (all k slots, as once the buffer is full)."""
        (B, NP, D), n_cam, slot = feats.shape, len(self.host.cfg.cameras), t % self.k
        buf[:, slot] = feats
        age = (slot - torch.arange(self.k, device=feats.device)) % self.k  # [k] age of each slot's frame
        x = buf.view(B, self.k, n_cam, NP // n_cam, D) + self.host.cam_embed + self.host.patch_pos  # [B,k,n_cam,P,D]
        x = x.reshape(B, self.k, NP, D) + self.frame_embed[age]  # [B, k, NP, D] + [k, 1, D]
        lang = self.host.instr_embed(instr)[:, None]  # [B, 1, D]
        return {"tokens": torch.cat([x.reshape(B, self.k * NP, D), lang], 1)}  # [B, k NP + 1, D]


@torch.no_grad()
def part2(args):
    device, ts, ks, late = args.device, (1, LATE), ((1, 8) if args.quick else (1, 4, 8, 16)), f"DRAM t={LATE}"
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)
    rows, headline = [], []
    for size in args.sizes:
        torch.manual_seed(0)
        host, base = make_bench_host(size, "dram", device).eval(), make_bench_host(size, "none", device).eval()
        cfg, NP, D = host.cfg, len(host.cfg.cameras) * host.tower.n_patches, host.tower.width  # NP: n_cam P
        instr = torch.zeros(1, dtype=torch.long, device=device)
        svec, noise = rand(1, cfg.state_dim), rand(1, cfg.chunk, cfg.action_dim)  # [1, Ds], [1, C, Da]
        feats, pool = rand(1, NP, D), rand(16, 1, NP, D)  # the timed step's frame; frames that advance the memory
        shape = (1, cfg.image_size, cfg.image_size, 3)
        images = {c: torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device) for c in cfg.cameras}
        states, S = {}, host.init_state(1, device)
        for t in range(1, max(ts) + 1):  # S_t after t read-write transitions
            _, S = host.step(pool[t % len(pool)], instr, S)
            if t in ts:
                states[t] = S.clone()
        ctxs = {k: KFrameContext(base, k).to(device).eval() for k in ks}
        bufs = {k: rand(1, k, NP, D) for k in ks}  # full ring buffers [1, k, NP, D]
        # one control step: the memory's read-write transition (or the ring-buffer write), then one action chunk
        fns = {f"DRAM t={t}": lambda S=states[t]: host.sample(host.step(feats, instr, S)[0], svec, instr, noise)
               for t in ts}
        fns |= {f"k={k}": lambda k=k: base.sample(ctxs[k].step(feats, instr, bufs[k], 2 * k - 1), svec, instr, noise)
                for k in ks}
        fns["encoder"] = lambda: host.encode(images)
        tokens = {f"DRAM t={t}": NP + 1 for t in ts} | {f"k={k}": k * NP + 1 for k in ks}  # the head's context
        runs = {"eager": fns}
        if device.type == "cuda":  # replayed as CUDA graphs, as eval.py deploys a policy on a GPU
            runs["CUDA graph"] = {k: capture_cuda_graph(f, device=device)[0].replay for k, f in fns.items()}
        for how, run in runs.items():
            per = timeit(run, args)
            x = {late: ratio(per, late, "DRAM t=1")} | {f"k={k}": ratio(per, f"k={k}", late) for k in ks}
            rows += [[size, how, name, tokens.get(name, "-"), ms(per, name), f"{x[name]:.2f}" if name in x else "-"]
                     for name in run]
        headline += [(f"control step, DRAM at t={LATE} vs t=1 ({size}, {how})", x[late], f"t={LATE} / t=1"),
                     (f"control step, k=8 context vs DRAM ({size}, {how})", x["k=8"], "k=8 / DRAM")]
    return table("Part 2: control-step latency (B = 1)", ["size", "run", "policy", "head tokens", "ms", "x"], rows,
                 "One step = host.step (DRAM: one read-write transition of the memory) or the ring-buffer write "
                 "(k frames), then host.sample (one action chunk); the frozen encoder runs once per frame on either "
                 f"side. x: {late} = time / DRAM t=1; k = time / {late}."), headline


# ---- Part 3: training time per frame, DRAM against the memoryless host -------------------------------------------
def make_train_step(host, B, T, g):
    """One train.train_step on B streams x T frames of cached features (random tensors of the tower's output shape),
    with train.py's optimizer and clip at their defaults and a memory state carried over from a previous window."""
    cfg, dev, a = host.cfg, host.patch_pos.device, train_args()
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dev)
    ones = lambda *shape: torch.ones(*shape, dtype=torch.bool, device=dev)
    batch = dict(tokens=rand(B, T, len(cfg.cameras) * host.tower.n_patches, host.tower.width),  # [B, T, n_cam P, D]
                 instr=torch.zeros(B, dtype=torch.long, device=dev),  # [B]
                 state=rand(B, T, cfg.state_dim),  # [B, T, Ds]
                 actions=rand(B, T, cfg.chunk, cfg.action_dim),  # [B, T, C, Da]
                 action_mask=ones(B, T, cfg.chunk), frame_valid=ones(B, T), reset=~ones(B))
    S0 = 0.1 * rand(*host.init_state(B).shape)  # [B, ...] (empty for the memoryless host)
    opt = train.make_optimizer(host, a.lr, a.weight_decay, a.mem_lr_mult)
    return lambda: train.train_step(host, opt, host.trainable_parameters(), batch, S0, a.clip)


def part3(args):
    g, rows, headline = torch.Generator().manual_seed(0), [], []
    for size in args.sizes:
        # B streams x T frames: both sides' cost is linear in B T and x is per frame, so fewer on the CPU
        B, T = (8, 16) if args.device.type == "cuda" else (1, 2) if size == "gr00t" else (4, 8)
        torch.manual_seed(0)
        steps = {m: make_train_step(make_bench_host(size, m, args.device).train(), B, T, g) for m in ("dram", "none")}
        per = timeit(steps, args)
        x = ratio(per, "dram", "none")
        rows.append([size, f"{B} x {T}", ms(per, "dram", B * T), ms(per, "none", B * T), f"{x:.2f}"])
        headline.append((f"training time per frame, DRAM vs memoryless ({size})", x, "DRAM / memoryless"))
    return table("Part 3: training step (train.train_step) per frame, DRAM vs the memoryless host",
                 ["size", "B x T", "DRAM ms / frame", "memoryless ms / frame", "x"], rows,
                 "Cached features; bf16 autocast on CUDA as in train.py. x = DRAM time / memoryless time."), headline


# ---- Part 4: the data path, batches gathered between steps against data.Prefetch ---------------------------------
def part4(args):
    B, T = (16, 16) if args.device.type == "cuda" else (4, 8)
    rounds, per_round = (2, 3) if args.quick else (5, 4)
    sync = torch.cuda.synchronize if args.device.type == "cuda" else (lambda: None)
    rows, headline, rng = [], [], np.random.default_rng(0)
    for name in ("dit", "vla"):
        a = train_args(name)
        torch.manual_seed(0)
        host = make_bench_host("libero", "dram", args.device, host=name).train()
        s, cams = host.cfg.image_size, host.cfg.cameras
        shape = host.encode({c: torch.zeros(1, s, s, 3, dtype=torch.uint8) for c in cams},
                            torch.zeros(1, dtype=torch.long)).shape[1:]  # [n_tok, D] a cached frame's features
        eps = [data.Episode(tokens=rng.standard_normal((64, *shape), np.float32).astype(np.float16),
                            state=rng.standard_normal((64, 8), np.float32), actions=rng.uniform(-1, 1, (64, 7)),
                            instruction="bench") for i in range(8)]  # in memory (page cache)
        fd, params = data.FrameData(eps), host.trainable_parameters()
        opt = train.make_optimizer(host, a.lr, a.weight_decay, a.mem_lr_mult)
        sampler = {k: data.StreamSampler(fd.lengths, B, T, host.cfg.chunk) for k in ("main thread", "Prefetch")}
        prefetch, state = data.Prefetch(fd, sampler["Prefetch"], args.device), host.init_state(B, args.device)
        wait, step = {k: [] for k in sampler}, {k: [] for k in sampler}  # s per step: waiting for the batch, all
        for r in range(rounds):
            for how in sampler:
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    batch = (prefetch.next()[0] if how == "Prefetch" else
                             fd.batch(sampler[how].next_window(), device=args.device))
                    t1 = time.perf_counter()
                    _, _, state = train.train_step(host, opt, params, batch, state, a.clip)
                    sync()
                    wait[how].append(t1 - t0)
                    step[how].append(time.perf_counter() - t0)
        prefetch.close()
        share = {k: sum(wait[k]) / sum(step[k]) for k in sampler}
        rounds_s = {k: [sum(v[r * per_round : (r + 1) * per_round]) for r in range(rounds)] for k, v in step.items()}
        x = ratio(rounds_s, "main thread", "Prefetch")  # s per round of per_round steps, each side
        rows += [[name, f"{B} x {T} x {tuple(shape)}", k, f"{1e3 * statistics.median(step[k]):.0f}",
                  f"{1e3 * statistics.median(wait[k]):.1f}", f"{100 * share[k]:.1f} %"] for k in sampler]
        headline.append((f"train.py step, batch gathered between steps vs Prefetch ({name})", x, "main / Prefetch"))
    return table("Part 4: train.py's loop, batches gathered on the main thread vs data.Prefetch",
                 ["host", "B x T x frame", "gathered by", "step ms", "wait ms", "wait / step"], rows,
                 "LIBERO sizes (train.py's settings, random tower weights), cached features in memory; wait: the "
                 "main thread's time until its batch is ready, its share summed over all steps."), headline


# ---- Command line ------------------------------------------------------------------------------------------------
PARTS = {1: part1, 2: part2, 3: part3, 4: part4}


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default: %(default)s)")
    p.add_argument("--parts", nargs="+", type=int, choices=list(PARTS), default=list(PARTS),
                   help="(default: 1 2 3 4)")
    p.add_argument("--sizes", nargs="+", choices=list(HOST_SIZES), help="parts 2-3 (default: libero; cuda: + gr00t)")
    p.add_argument("--quick", action="store_true", help="part 1 at P = 32, part 2 at k = 1, 8; shorter (default: off)")
    p.add_argument("--out", help="folder to write bench.md into (default: none, print only)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file, not a folder")
    args.device = torch.device(args.device)
    args.sizes = args.sizes or (["libero"] if args.device.type == "cpu" else ["libero", "gr00t"])
    command = "python bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"{machine(args.device)}, torch {torch.__version__}\n{command}\n", flush=True)
    t0, sections, headline = time.perf_counter(), [], []
    for k in args.parts:
        text, rows = PARTS[k](args)
        sections.append(text)
        headline += rows
        print(sections[-1], flush=True)
    head = table("Headline", ["measured", "x", "x ="], [(what, f"{x:.2f}", meaning) for what, x, meaning in headline])
    about = f"{machine(args.device)}, torch {torch.__version__}, {time.perf_counter() - t0:.0f} s; `{command}`"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "bench.md").write_text(f"## DRAM benchmark\n\n{about}\n\n{head}\n" + "\n".join(sections))
        print(f"wrote {Path(args.out, 'bench.md')}")
    print(f"\n{about}\n\n{head}")


if __name__ == "__main__":
    main()

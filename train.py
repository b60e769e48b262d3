"""
Post-train DRAM on a frozen host policy with truncated BPTT and flow matching (paper Sec. 3.4).

  python train.py                                          # DiT host + DRAM on the embedded memory suite (CPU, minutes)
  python train.py --memory none                            # the matched memoryless baseline
  python train.py --suite mikasa                           # MIKASA-Robo's VLA tasks (expert demos made on first use)
  python train.py --host dit --suite libero_10 --data DIR  # LIBERO (official HDF5 demos)
  python train.py --host vla --write-source native_kv      # pi0.5-style host, separate-source memory
  torchrun --nproc_per_node 2 train.py ...                 # DDP: each rank its own streams

The memory, adapters and action head train; the frozen tower encodes each frame once into the feature cache (data.py).
B streams walk whole episodes in windows of T frames, gradients through the whole window; a stream's memory state is
carried to its next window (detached there) and zeroed when it starts an episode. On the embedded suite the run also
rolls out its last checkpoints on layouts of their own and keeps the best as <out>/best.pt (VALIDATE).
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data
from hosts import ConfigError, HostConfig, check_config, load_weights, make_host
from hosts import nonfinite, read_checkpoint, save_checkpoint

# Embedded-suite defaults; the hosts' architecture defaults are HostConfig's. STEPS: about 12 (dit) and 27 (vla)
# minutes of training on 2 idle CPU cores. MEM_LR_MULT: the memory layers' lr, relative to --lr.
STEPS = dict(dit=2200, vla=1800)
# MIKASA-Robo: an episode (25 frames) is one window, so the loss of every decision reaches the cue frames' writes;
# 15,000 demo frames take fewer steps than the embedded suite's 27,000 (4,000 fit the demos closer, score no higher)
MIKASA = dict(window=25, steps=1500)
WINDOW, BATCH = 16, 16  # frames per TBPTT window and streams elsewhere
# LIBERO on one GPU, both hosts (d_model: the dit host's; the vla expert has its backbone's width). 50 demos per task,
# up to 193 / 254 / 270 / 505 / 373 frames (spatial / object / goal / 10 / 90). window: a decision's loss reaches only
# the writes within its window, so it spans 1.6 s at 20 Hz, 3.2 s on libero_10, whose tasks are two in a row. batch:
# B streams over as many demos, B x T = 1,024 or 2,048 frames a step (bf16; by estimate a few GB of activations).
# steps: about 100-300 passes over a suite's frames (~60,000 in a 10-task suite, 150,000 or so in libero_10,
# ~600,000 in libero_90). d_model 256: ten tasks' 500 demos ask more of the head than the embedded suite's 128.
# 8 memory heads of 32: twice the embedded suite's, for the objects and stages a LIBERO task must keep track of.
# query slots (vla): the paper's pi0.5 instantiation; a copy of the frame's 129 tokens would be the expert's prefix.
LIBERO_HEAD = dict(d_model=256, mem_heads=8, mem_dim=32, query="slots")
TEN_SHORT_TASKS = dict(steps=10000, batch=32, window=32, **LIBERO_HEAD)
LIBERO = dict(libero_spatial=TEN_SHORT_TASKS, libero_object=TEN_SHORT_TASKS, libero_goal=TEN_SHORT_TASKS,
              libero_10=dict(steps=15000, batch=32, window=64, **LIBERO_HEAD),
              libero_90=dict(steps=40000, batch=64, window=32, **LIBERO_HEAD))
MEM_LR_MULT = dict(dit=2.0, vla=2.5)
# The vla host on the embedded suite: 8 memory heads of 16, the 128 key dimensions of HostConfig's 4 of 32 split
# twice as finely. Each head's write gates choose on their own which of a frame's 33 tokens to store: with 4 heads of
# 32 seed 2's state never holds the cued block (cue_location 44 %); with 8 of 16 it does (84 %); 8 of 32 lose seed 0.
VLA_MEMORY = dict(mem_heads=8, mem_dim=16)
# Checkpoint selection (embedded suite): a run's late checkpoints differ by 10-30 points on a task while its loss still
# falls, so the run rolls out its checkpoints at these fractions of --steps on layouts of their own (no evaluation's:
# eval.py's default seed is 7, the demos' 0, train.py's quick eval 1000 + --seed) and keeps the best as best.pt
VALIDATE = dict(at=(0.75, 0.875, 1.0), episodes=20, seed=99)
DIT_MEMORY_DEPTH = 1  # the dit host on the embedded suite (HostConfig.mem_depth: the vla host, and LIBERO)
VLA_ONLY = ("write_source", "query", "vla_layers", "pos_code", "key_norm", "kv_adapter", "write_centre")
DIT_ONLY = ("mixer", "d_model", "head_blocks")  # the vla host's expert has its backbone's width and depth
PROJECTED = ("mem_heads", "mem_dim")  # native_kv writes the backbone's own heads, without DRAM's projections
VLA_FEATURES = "h0-hL"  # the vla host's cached features: hidden states h_0 .. h_L (hosts.VLAHost.encode)
LIBERO_CHUNK = 10  # openpi's action chunk on LIBERO; eval.py --replan 5 executes half of it, as openpi does


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default; one that depends on the suite (None here) or is empty, the help text states."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, "") else super()._get_help_string(action)


def parser():
    p = argparse.ArgumentParser(description="Truncated-BPTT training of DRAM on a frozen host policy",
                                formatter_class=Help)
    p.add_argument("--host", default="dit", choices=["dit", "vla"], help="shared (dit) or separate (vla) source")
    p.add_argument("--memory", default="dram", choices=["dram", "none"], help="none: the memoryless baseline")
    p.add_argument("--write-source", choices=["native_kv", "hidden", "last_hidden"],
                   help=f"vla host: what the memory layers write (default: {HostConfig.write_source})")
    p.add_argument("--query", choices=["frame", "slots"], help=f"vla host: the memory's query stream, a copy of the "
                   f"frame's last hidden tokens or {HostConfig.query_slots} learned slots (default: "
                   f"{HostConfig.query}; LIBERO {LIBERO_HEAD['query']})")
    p.add_argument("--suite", default="memory", choices=list(data.SUITES), help="task suite")
    p.add_argument("--data", default=data.DEFAULT_DATA_ROOT, help="data root: <data>/<suite>/*_demo.hdf5, only "
                   "read (the embedded suite is generated into the default root only)")
    p.add_argument("--tasks", nargs="+", help="train on (and generate) these tasks of --suite only: their names, as in "
                   "<data>/<suite>/<name>_demo.hdf5; pass an --out of its own (default: all the folder holds)")
    p.add_argument("--cache-dir", default=data.DEFAULT_CACHE_DIR, help="feature cache folder")
    p.add_argument("--no-cache", action="store_true", help="encode frames in memory, do not read/write the cache")
    p.add_argument("--vision", help=f"timm tower (default: {HostConfig.vision}; LIBERO vit_small_patch16_224.dino)")
    p.add_argument("--image-size", type=int, help=f"tower input size (default: {HostConfig.image_size}; LIBERO 128)")
    p.add_argument("--pretrained", action=argparse.BooleanOptionalAction,
                   help="load the tower's pretrained timm weights (default: on for LIBERO, off for the embedded suite)")
    p.add_argument("--weights-file", default="", help="local weights file for the tower (offline; default: none)")
    p.add_argument("--window", type=int, help=f"TBPTT window T in frames (default: {WINDOW}; mikasa "
                   f"{MIKASA['window']}; LIBERO per suite: train.LIBERO)")
    p.add_argument("--chunk", type=int, help=f"action chunk C (default: {HostConfig.chunk}; LIBERO {LIBERO_CHUNK})")
    p.add_argument("--steps", type=int, help=f"training steps (default: {STEPS['dit']} dit, {STEPS['vla']} vla; "
                   f"mikasa {MIKASA['steps']}; LIBERO per suite: train.LIBERO)")
    p.add_argument("--batch", type=int, help=f"parallel streams B per rank (default: {BATCH}; LIBERO per suite: "
                   f"train.LIBERO)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (weight matrices only)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--mem-lr-mult", type=float, help=f"peak lr of the memory layers (host.memory; the vla host's "
                   f"query slots and prefix projections train at --lr) = this x --lr (default: {MEM_LR_MULT['dit']:g} "
                   f"dit, {MEM_LR_MULT['vla']:g} vla)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (inf: none)")
    p.add_argument("--episodes", type=int, help="embedded / mikasa suite: demos per task, generated once into the "
                   f"default --data (default: {data.MEMORY_EPISODES} / {data.MIKASA_EPISODES}, or what the existing "
                   "files hold)")
    p.add_argument("--mem-depth", type=int, help=f"memory layers (default: {HostConfig.mem_depth}; "
                   f"{DIT_MEMORY_DEPTH} for the dit host on the embedded suite)")
    p.add_argument("--mem-heads", type=int, help=f"memory heads H (default: {HostConfig.mem_heads}; vla on the "
                   f"embedded suite {VLA_MEMORY['mem_heads']}; LIBERO {LIBERO_HEAD['mem_heads']})")
    p.add_argument("--mem-dim", type=int, help=f"d_k = d_v per memory head (default: {HostConfig.mem_dk}; vla on the "
                   f"embedded suite {VLA_MEMORY['mem_dim']}; LIBERO {LIBERO_HEAD['mem_dim']})")
    p.add_argument("--d-model", type=int, help=f"dit host: action head width (default: {HostConfig.d_model}; LIBERO "
                   f"{LIBERO_HEAD['d_model']})")
    p.add_argument("--head-blocks", type=int, help="dit host: DiT blocks, alternating cross / self attention "
                   f"(default: {HostConfig.head_blocks})")
    p.add_argument("--vla-layers", type=int, help=f"vla host: backbone layers used (default: {HostConfig.vla_layers})")
    p.add_argument("--pos-code", action=argparse.BooleanOptionalAction, help="vla host: fixed position + camera "
                   "code on the patch tokens (default: on without --pretrained, whose tower embeds position itself)")
    p.add_argument("--key-norm", action=argparse.BooleanOptionalAction, help="vla host: RMS-normalise the keys the "
                   "action expert attends to, per head (default: on)")
    p.add_argument("--kv-adapter", action=argparse.BooleanOptionalAction, help="vla host: a learned linear map per "
                   "expert layer on the backbone keys and values it reads, identity at the start (default: on)")
    p.add_argument("--write-centre", action=argparse.BooleanOptionalAction, help="vla host: the memory writes its "
                   "sources minus their mean over the frame's tokens (default: on)")
    p.add_argument("--flow-steps", type=int, default=HostConfig.flow_steps, help="Euler steps when sampling actions")
    p.add_argument("--mixer", action="store_true", default=None, help="dit host: intra-frame mixer after each fuse "
                   "(default: off)")
    p.add_argument("--out", help="run directory (default: runs/<host>-<memory>-<suite>)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/ckpt.pt")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an --out that holds a run, replacing it")
    p.add_argument("--save-every", type=int, default=250, help="checkpoint every this many steps")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--device", default="auto", help="auto: one GPU per process if there are enough, else cpu")
    p.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)  # tests: simulate an interruption
    p.add_argument("--eval-episodes", type=int, default=10, help="final eval (memory suite): episodes per task, 0: off")
    p.add_argument("--val-episodes", type=int, help=f"memory suite: validation rollouts per task of the checkpoints at "
                   f"{', '.join(f'{f:g}' for f in VALIDATE['at'])} x --steps (eval.py --seed {VALIDATE['seed']}'s "
                   f"layouts); the best becomes <out>/best.pt (default: {VALIDATE['episodes']}; 0: off)")
    return p


def get_args(argv=None, run_folder=True):
    """argv -> the settings of the run, every default filled in; a bad value is one line naming the flag (exit 2).
    run_folder=False: not checked against --out (bench.py times train.py's step without training a run)."""
    p = parser()
    a = p.parse_args(argv)
    for k in ("steps", "batch", "window", "chunk", "episodes", "save_every", "mem_depth", "mem_heads", "mem_dim",
              "d_model", "head_blocks", "vla_layers", "flow_steps", "warmup", "eval_episodes", "val_episodes"):
        lo = 0 if k in ("warmup", "eval_episodes", "val_episodes") else 1
        if getattr(a, k) is not None and getattr(a, k) < lo:
            p.error(f"--{k.replace('_', '-')} must be >= {lo}, got {getattr(a, k)}")
    mikasa = a.suite in data.MIKASA_SUITES
    recipe = LIBERO.get(a.suite) or (VLA_MEMORY if a.host == "vla" and a.suite == data.MEMORY_SUITE else {})
    a.steps = a.steps or recipe.get("steps") or (MIKASA["steps"] if mikasa else STEPS[a.host])
    a.window = a.window or recipe.get("window") or (MIKASA["window"] if mikasa else WINDOW)
    a.batch = a.batch or recipe.get("batch", BATCH)
    a.mem_lr_mult = MEM_LR_MULT[a.host] if a.mem_lr_mult is None else a.mem_lr_mult
    if a.val_episodes and a.suite != data.MEMORY_SUITE:  # rollouts on held-out layouts: the embedded suite's own
        p.error(f"--val-episodes: the embedded memory suite only, not --suite {a.suite}")
    if a.val_episodes is None:
        a.val_episodes = VALIDATE["episodes"] if a.suite == data.MEMORY_SUITE else 0
    for k, lo, strict in (("lr", 0.0, True), ("weight_decay", 0.0, False), ("mem_lr_mult", 0.0, False)):
        v = getattr(a, k)
        if not (math.isfinite(v) and (v > lo if strict else v >= lo)):
            p.error(f"--{k.replace('_', '-')} must be a finite number {'>' if strict else '>='} {lo:g}, got {v}")
    if not a.clip > 0:
        p.error(f"--clip must be > 0 (inf: no clipping), got {a.clip}")
    if not 0 <= a.seed < 2 ** 32:
        p.error(f"--seed must be in [0, 2**32), got {a.seed}")
    if a.device != "auto":
        try:
            torch.device(a.device)
        except RuntimeError as e:
            p.error(f"--device {a.device}: {e}")
    if a.weights_file and not Path(a.weights_file).is_file():
        p.error(f"--weights-file {a.weights_file}: no such file")
    # a flag that means nothing to the host it is given for is refused, not ignored
    why = (dict.fromkeys(VLA_ONLY, "the dit host, whose memory writes its frame tokens (vla host: --host vla)")
           if a.host == "dit" else dict.fromkeys(DIT_ONLY, "the vla host, whose action expert has its backbone's "
                                                 "width and depth (--vla-layers)"))
    why |= dict.fromkeys(PROJECTED if a.write_source == "native_kv" else (), "--write-source native_kv, whose memory "
                         "writes the backbone's own heads (their number and width)")
    if given := [k for k in why if getattr(a, k) is not None]:
        p.error(f"--{given[0].replace('_', '-')} is not an option of {why[given[0]]}")
    if a.host == "vla" and a.mem_depth is not None and a.write_source not in (None, "last_hidden"):  # one per layer
        p.error(f"--mem-depth applies to --write-source last_hidden; with {a.write_source} the vla host has one memory "
                f"layer per backbone layer (--vla-layers)")
    lib, c = not (a.suite == data.MEMORY_SUITE or mikasa), HostConfig  # mikasa: the embedded suite's CPU recipe
    a.write_source, a.vla_layers = a.write_source or c.write_source, a.vla_layers or c.vla_layers
    a.query = a.query or recipe.get("query", c.query)
    a.key_norm, a.kv_adapter = a.key_norm is not False, a.kv_adapter is not False
    a.write_centre, a.mixer = a.write_centre is not False, bool(a.mixer)
    a.mem_heads = a.mem_heads or recipe.get("mem_heads", c.mem_heads)
    a.mem_dim = a.mem_dim or recipe.get("mem_dim", c.mem_dk)
    a.d_model, a.head_blocks = a.d_model or recipe.get("d_model", c.d_model), a.head_blocks or c.head_blocks
    a.chunk = a.chunk or (LIBERO_CHUNK if lib else c.chunk)
    a.vision = a.vision or ("vit_small_patch16_224.dino" if lib else c.vision)
    a.image_size = a.image_size or (128 if lib else c.image_size)
    a.pretrained = lib if a.pretrained is None else a.pretrained
    a.mem_depth = a.mem_depth or (c.mem_depth if lib or a.host == "vla" else DIT_MEMORY_DEPTH)
    a.pos_code = not a.pretrained if a.pos_code is None else a.pos_code
    try:  # the host configuration's own checks, before any data is generated or encoded
        host_config(a, vocab=(), action_dim=1)
    except ConfigError as e:
        p.error(str(e))
    a.out = a.out or f"runs/{a.host}-{a.memory}-{a.suite}"
    if not run_folder:
        return a
    if Path(a.out).exists() and not Path(a.out).is_dir():
        p.error(f"--out {a.out} is a file, not a folder")
    if a.resume and a.overwrite:
        p.error("--resume continues the run in --out, --overwrite replaces it: pass one of them")
    if not (a.resume or a.overwrite) and (Path(a.out) / "ckpt.pt").exists():
        p.error(f"--out {a.out} holds a run (ckpt.pt): continue it with --resume, train into another --out, or "
                f"replace it with --overwrite")
    return a


def host_config(a, vocab, action_dim):
    """The host a run trains: get_args' settings, the data's instructions and action width."""
    given = {k: getattr(a, k) for k in HostConfig.__dataclass_fields__ if hasattr(a, k)}  # flags named as fields
    return HostConfig(**given, vocab=vocab, action_dim=action_dim, mem_dk=a.mem_dim, mem_dv=a.mem_dim)


RESUME_THIS_RUN = ("resume", "overwrite", "out", "data", "cache_dir", "no_cache", "device", "stop_at", "save_every",
                   "eval_episodes", "weights_file")  # where and how this process runs
RESUME_SCHEDULE = ("steps", "lr", "warmup", "weight_decay", "mem_lr_mult", "clip",  # may change: train on to more
                   "val_episodes")  # steps (its new late checkpoints are validated; the earlier ones stay candidates)


def resume_args(a, saved, argv, path):
    """The saved run's arguments, except RESUME_THIS_RUN and what the command line gives again. A given model, data or
    sampler setting that differs is an error: the weights would not load, or the stream of windows would change."""
    p, unset = parser(), object()  # given: the destinations set on the command line itself, not by a default
    p.set_defaults(**{k: unset for k in vars(p.parse_args(argv))})
    given = {k for k, v in vars(p.parse_args(argv)).items() if v is not unset}
    a = argparse.Namespace(**vars(a))
    for k, v in saved.items():
        if k in RESUME_THIS_RUN:
            continue
        if k not in given:
            setattr(a, k, v)
        elif getattr(a, k) != v and k in RESUME_SCHEDULE:
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"--resume: --{k.replace('_', '-')} {getattr(a, k)} (the saved run had {v})")
        elif getattr(a, k) != v:
            raise ConfigError(f"--resume: {path} was trained with --{k.replace('_', '-')} {v!r}, this run asks for "
                              f"{getattr(a, k)!r}; leave the flag out to continue the saved run, or train a new run "
                              f"with another --out")
    return a


def best_validated(val):
    """[step, rate] of the best validated checkpoint in val; a tie goes to the later step."""
    return max(reversed(val), key=lambda v: v[1])


def lr_at(step, a):
    """Linear warm-up, then cosine decay to 10%."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    prog = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


# ---- One training step -------------------------------------------------------------------------------------------
def all_reduce_grads(params):
    """Sum the gradients of `params` over the ranks in one all-reduce of a flat buffer (a parameter this rank left
    without a gradient adds zeros); each .grad becomes a view into the sum."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])  # [P]
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)  # [numel] -> p's shape


def train_step(host, opt, params, batch, state, clip, world=1):
    """One TBPTT step: zero the memory rows of streams that start an episode, flow-matching loss (eq. fm, mean over
    the valid frames of all ranks), backward through the whole window, clip, AdamW. state [B, ...]: carried from the
    stream's previous window (detached there). -> (loss [] over all ranks, this rank's valid frames [], new state
    detached)."""
    state = host.reset_state(state.detach(), batch["reset"])
    # bf16 autocast on CUDA only; the joint solve stays fp32 by itself
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch["tokens"].is_cuda):
        loss_sum, n, state = host.loss(batch["tokens"], batch["instr"], state, batch["state"], batch["actions"],
                                       batch["action_mask"], batch["frame_valid"])
    total = torch.stack([loss_sum.detach().float(), n.float()])  # [2] loss sum, valid frames; n stays this rank's
    if world > 1:  # one call: every rank's loss and frames
        dist.all_reduce(total)
    loss = loss_sum / total[1].clamp(min=1)  # this rank's share of the mean over all ranks' valid frames
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if world > 1:  # the sum of the shares' gradients = the gradient of the mean over all valid frames
        all_reduce_grads(params)
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    return total[0] / total[1].clamp(min=1), n, state.detach()


def make_optimizer(host, lr, weight_decay, mem_lr_mult):
    """AdamW (betas 0.9, 0.95) in up to four groups (empty ones left out): weight decay on weight matrices only; the
    memory layers' parameters (host.memory) at `lr_mult` = mem_lr_mult x the scheduled lr, the rest at 1 x, the vla
    host's query slots and prefix projections included."""
    params = host.trainable_parameters()
    mem = set() if host.memory is None else {id(p) for p in host.memory.parameters()}
    groups = [dict(params=[p for p in params if (id(p) in mem) == is_mem and (p.dim() >= 2) == is_matrix],
                   weight_decay=weight_decay if is_matrix else 0.0, lr_mult=mem_lr_mult if is_mem else 1.0)
              for is_mem in (False, True) for is_matrix in (True, False)]
    return torch.optim.AdamW([dict(g, lr=lr * g["lr_mult"]) for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def rng_state(dev):
    """The generators a training step draws from: the CPU's and, on a GPU, `dev`'s (not the current device's)."""
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)


def set_rng_state(st, dev):
    torch.set_rng_state(st["torch"])
    if dev.type == "cuda" and st["cuda"] is not None:  # a checkpoint written on the CPU carries no CUDA state
        torch.cuda.set_rng_state(st["cuda"], dev)


# ---- Data -> host ------------------------------------------------------------------------------------------------
def scan(files):
    """Instructions {task name: instruction}, action dimension and camera frame size (H, W) from the demo files before
    any frame is encoded: every demo's shapes, dtypes, actions and states validated (data.check_values), no pixels
    read. The checkpoint keeps both: eval.py asks for a task's instruction by its name (data.task_name, LIBERO's
    task.name) and renders the simulator at this frame size."""
    instructions, demos, sizes = {}, [], {}  # sizes: (H, W) -> the first demo whose camera images have it
    for f in files:
        instructions[data.task_name(f)], ds = data.iter_demo_file(f, images=False)
        for d in ds:
            demos.append((f"{f}: data/{d.name}", d.state, d.actions))
            sizes.setdefault(d.frame_hw, demos[-1][0])
    if len(sizes) > 1:
        raise data.DataError(f"the demos' camera images differ in size: {sizes}")
    data.check_values(demos)  # also: one action width
    return instructions, demos[0][2].shape[1], next(iter(sizes))


def feature_cache_key(host):
    """Everything the cached features depend on: tower, image size and weights; vla: backbone layers, position code
    and the layout of VLAHost.encode's features (a cache of another layout is never read)."""
    c = host.cfg
    extra = dict(host=c.host, tower=host.tower.fingerprint())
    extra |= dict(layers=c.vla_layers, pos=int(c.pos_code), feats=VLA_FEATURES) if c.host == "vla" else {}
    return "_".join([c.vision, f"{c.image_size}px"] + [f"{k}={v}" for k, v in sorted(extra.items())])


def build_episodes(host, files, a, rank=0):
    key, eps = feature_cache_key(host), []
    for f in files:  # one call per file: the vla backbone also sees that file's (frozen) instruction token
        ids = host.instr_ids([data.iter_demo_file(f, images=False)[0]])  # [1]
        encode = lambda images: host.encode(images, ids.expand(len(next(iter(images.values())))))  # noqa: E731
        eps += data.build_feature_cache([f], encode, key, a.cache_dir, use_cache=not a.no_cache, progress=rank == 0)
    return eps


RANK0_WAIT = datetime.timedelta(hours=6)  # how long the others wait for rank 0 alone (feature cache, validation)


def setup_distributed(a):
    """torchrun's environment -> (rank, world, wait). One GPU per process on each machine (LOCAL_RANK of
    LOCAL_WORLD_SIZE), NCCL between GPUs, gloo between CPU processes. wait() holds every rank until all got there,
    on a gloo group with the timeout RANK0_WAIT (NCCL's watchdog would abort a barrier after 10 minutes)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # processes on this machine
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "cpu"
    cuda = torch.device(a.device).type == "cuda"
    if cuda and local_world > torch.cuda.device_count():
        raise ConfigError(f"--device {a.device}: {local_world} process(es) on this machine need one GPU each, this "
                          f"machine has {torch.cuda.device_count()} (use --device cpu, or fewer processes)")
    if cuda and world > 1 and torch.device(a.device).index is not None:
        raise ConfigError(f"--device {a.device}: with {world} processes each takes the GPU of its LOCAL_RANK; pass "
                          f"--device cuda")
    if world == 1:
        return rank, world, lambda: None
    if not cuda:  # ranks share the cores: oversubscribed OpenMP threads spin and crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        a.device = f"cuda:{local}"
    group = dist.new_group(backend="gloo", timeout=RANK0_WAIT)
    return rank, world, lambda: dist.barrier(group=group)


def main(argv=None):
    """Train; a mistake in the command or its files (DataError, ConfigError) is one line naming the fix, exit 2."""
    try:
        return run(argv)
    except (data.DataError, ConfigError) as e:
        parser().exit(2, f"train.py: error: {e}\n")


def run(argv=None):
    a = get_args(argv)
    out, ck = Path(a.out), None
    ckpt_path = out / "ckpt.pt"
    if a.resume:
        if not ckpt_path.is_file():
            raise ConfigError(f"--resume: no checkpoint at {ckpt_path}; check --out, or train without --resume")
        ck = read_checkpoint(ckpt_path)
        a = resume_args(a, ck["args"], argv, ckpt_path)
    rank, world, wait = setup_distributed(a)
    if rank == 0:  # checkpoint writes of killed runs (save_checkpoint's temporary files)
        data.remove_stale_tmp(out.glob("*.pt.tmp*"))
    if rank == 0 and a.overwrite:  # the replaced run goes, its selection with it
        for f in ("ckpt.pt", "best.pt"):
            (out / f).unlink(missing_ok=True)
        for d in out.glob("val/step*"):
            shutil.rmtree(d)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = torch.device(a.device)
    if ck is not None and ck["world"] != world:
        raise ConfigError(f"--resume: {ckpt_path} was trained by {ck['world']} process(es), this run has {world}: "
                          f"each process resumes its own streams")
    files = data.find_demo_files(a.data, a.suite, tasks=a.tasks, n_episodes=a.episodes) if rank == 0 else None
    if world > 1:  # rank 0 generates the embedded suite once; the others wait for it
        wait()
        files = data.find_demo_files(a.data, a.suite, generate=False, tasks=a.tasks)
    instructions, Da, frame_hw = scan(files)
    vocab = sorted(set(instructions.values()))  # one embedding per distinct instruction (tasks may share one)
    cfg = host_config(a, tuple(vocab), Da)
    if ck is not None:  # the data too must be the saved run's (instructions, action dimension)
        check_config(ck, ckpt_path, {k: v for k, v in dataclasses.asdict(cfg).items() if k != "weights_file"})
        if ck["instructions"] != instructions:
            raise ConfigError(f"--resume: {ckpt_path} was trained on the tasks {sorted(ck['instructions'])}, --data "
                              f"{a.data} gives {sorted(instructions)}; pass the saved run's --data and --tasks")
    host = make_host(a.host, cfg).to(dev)  # the same seed on every rank: the same initial weights
    if world > 1:  # then each rank its own draws of tau and noise
        torch.manual_seed(a.seed + rank)
    if ck is not None:
        load_weights(host, ck, ckpt_path)
    if rank == 0 and world > 1:
        build_episodes(host, files, a, rank)  # fill the cache once
    wait()
    episodes = build_episodes(host, files, a, rank)
    # normalisation statistics of all episodes (also under DDP), then each rank its own episodes and streams
    stats = ck["stats"] if ck is not None else data.compute_stats([e.state for e in episodes],
                                                                  [e.actions for e in episodes])
    fd = data.FrameData(episodes[rank::world], stats=stats, vocab=vocab)
    sampler = data.StreamSampler(fd.lengths, a.batch, a.window, a.chunk, seed=a.seed)
    params, opt = host.trainable_parameters(), make_optimizer(host, a.lr, a.weight_decay, a.mem_lr_mult)
    mem_state, step, losses = host.init_state(a.batch, dev), 0, []  # losses: the whole run's, for log.json
    validating = a.val_episodes and a.suite == data.MEMORY_SUITE  # (resume_args may have changed the suite)
    val_steps = sorted({round(f * a.steps) for f in VALIDATE["at"]}) if validating else []
    val = []  # [step, mean validation success] of the checkpoints validated so far
    if ck is not None:
        this_run = [(g["lr_mult"], g["weight_decay"]) for g in opt.param_groups]
        opt.load_state_dict(ck["optimizer"])
        for g, (m, wd) in zip(opt.param_groups, this_run):  # this run's --mem-lr-mult, --weight-decay
            g["lr_mult"], g["weight_decay"] = m, wd
        sampler.load_state_dict(ck["sampler"][rank])
        mem_state = ck["mem_state"][rank].to(dev)
        set_rng_state(ck["rng"][rank], dev)
        step, losses, val = ck["step"], list(ck["losses"]), [list(v) for v in ck.get("val", [])]
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}")

    def checkpoint():
        """Every rank gives its sampler position, memory state and RNG; rank 0 writes, never non-finite weights."""
        trained = {n: p.detach() for n, p in host.named_parameters() if p.requires_grad}  # (the tower is not stored)
        if bad := nonfinite(trained):
            raise FloatingPointError(f"step {step}: the weights hold NaN/inf ({', '.join(bad[:3])}); {ckpt_path} is "
                                     f"not written. Lower --lr, or check --weight-decay / --mem-lr-mult and the data")
        mine = dict(sampler=consumed, mem=mem_state.detach().cpu(), rng=rng_state(dev))
        gathered = [mine] if world == 1 else [None] * world
        if world > 1:
            dist.all_gather_object(gathered, mine)
        if rank == 0:
            save_checkpoint(ckpt_path, dict(
                model={n: p.cpu() for n, p in trained.items()}, config=dataclasses.asdict(cfg),
                stats={k: torch.from_numpy(v) for k, v in fd.stats.items()},  # tensors: read with weights_only
                vocab=vocab, instructions=instructions, optimizer=opt.state_dict(), step=step,
                sampler=[g["sampler"] for g in gathered], mem_state=[g["mem"] for g in gathered],
                rng=[g["rng"] for g in gathered],
                tower_fingerprint=host.tower.fingerprint(), args=vars(a), suite=a.suite, world=world,
                losses=losses, val=val, frame_size=list(frame_hw)))

    def validate():
        """Roll out ckpt.pt on the validation layouts (rank 0); the best so far (a tie: the later) is copied to best.pt,
        byte for byte (its sha1 is the one in the validation's log); then ckpt.pt records the rate: a run stopped
        before that validates again. The training run's random stream is left as it was."""
        if rank == 0:
            import eval as evaluation
            rng, where = rng_state(dev), out / "val" / f"step{step}"
            shutil.rmtree(where, ignore_errors=True)  # a validation cut short is run again
            s = evaluation.evaluate_checkpoints([str(ckpt_path)], trials=a.val_episodes, seed=VALIDATE["seed"],
                                                device=a.device, out=str(where), tasks=trained_tasks)
            set_rng_state(rng, dev)
            val.append([step, s[str(ckpt_path)]["mean"]])
            if best_validated(val)[0] == step:
                save_checkpoint(out / "best.pt", ckpt_path)
        wait()  # the other ranks wait for rank 0's rollouts on the long-timeout group, not in checkpoint()'s gather
        checkpoint()

    trained_tasks = None if a.suite != data.MEMORY_SUITE else sorted(list(data.MEMORY_TASKS).index(t)
                                                                       for t in instructions)
    due = lambda: step in val_steps and step not in [s for s, _ in val]  # noqa: E731
    host.train()
    bar = tqdm(total=a.steps, initial=step, disable=rank != 0, desc=f"train {a.host}/{a.memory}", unit="step")
    t0, frames, stop = time.time(), 0, a.steps if a.stop_at is None else min(a.steps, a.stop_at)
    consumed, batches = sampler.state_dict(), data.Prefetch(fd, sampler, dev)  # consumed: the checkpoint's position
    if due():  # the run was stopped while it validated this checkpoint
        validate()
    while step < stop:
        batch, consumed = batches.next()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a) * g["lr_mult"]
        loss, n, mem_state = train_step(host, opt, params, batch, mem_state, a.clip, world=world)
        step += 1
        frames += int(n)
        lv = loss.item()  # the mean over all ranks' valid frames
        if not math.isfinite(lv):
            raise FloatingPointError(f"loss is {lv} at step {step}; lower --lr or check the data")
        losses.append(lv)
        bar.update(1)
        if step % 10 == 0 or step == stop:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}", lr=f"{lr_at(step, a):.2e}",
                            fps=f"{frames * world / (time.time() - t0):.0f}")
        if step % a.save_every == 0 or step == stop or step in val_steps:
            checkpoint()
        if due():
            validate()
    batches.close()
    bar.close()
    if rank == 0:
        (out / "log.json").write_text(json.dumps(dict(losses=losses, val=val, args=vars(a)), indent=1))
        print(f"checkpoint: {ckpt_path}  (step {step}, loss {np.mean(losses[-50:]) if losses else float('nan'):.4f})")
        if val:
            best = best_validated(val)
            print(f"best.pt: the checkpoint of step {best[0]}, {100 * best[1]:.1f} % mean success over "
                  f"{a.val_episodes} validation episodes per task (of steps {', '.join(str(s) for s, _ in val)})")
    if world > 1:  # the all-reduced gradients must keep every rank's weights identical
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        if not torch.equal(flat, ref):
            raise RuntimeError(f"DDP rank {rank}'s weights differ from rank 0's")
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0 and step >= a.steps and a.suite == data.MEMORY_SUITE and a.eval_episodes > 0:
        import eval as evaluation  # a quick pass on the embedded suite: the first command shows whether memory works
        # its own log folder, evaluated afresh: eval.py's default folder stays free for the full evaluation
        (out / "eval_quick" / "episodes.jsonl").unlink(missing_ok=True)
        policy = out / "best.pt" if val else ckpt_path
        evaluation.evaluate_checkpoints([str(policy)], trials=a.eval_episodes, seed=a.seed + 1000, device=a.device,
                                        out=str(out / "eval_quick"), tasks=trained_tasks)
    return str(ckpt_path)


if __name__ == "__main__":
    main()

"""
Data for DRAM post-training: LIBERO demo HDF5 reader, the embedded memory suite (env + scripted expert +
generator), normalisation statistics, the frozen-feature cache and the streaming TBPTT sampler (paper Sec. 3.4).

  python data.py --suite memory                      # write ./data/memory/<task>_demo.hdf5 (LIBERO layout)
  python data.py --suite libero_10 --data-root DIR   # validate a LIBERO suite and print a summary

Pipeline (train.py): find_demo_files -> build_feature_cache (encodes every frame once with the frozen tower)
-> FrameData (normalised state/actions, lazily read tokens) -> StreamSampler windows -> FrameData.batch.

Shared raw observation format (LIBERO's demo `obs/` keys; the embedded env and eval.py's LIBERO wrapper emit it):
  agentview_rgb uint8 [H,W,3] and eye_in_hand_rgb uint8 [H,W,3], both upside down (OpenGL convention),
  ee_states float [6] (eef position + axis-angle), gripper_states float [2] (finger qpos).
policy_frame() is the ONE place that turns it into policy inputs (upright images, 8-d state).
"""
import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch
from tqdm import tqdm

CAMERAS = ("agentview_rgb", "eye_in_hand_rgb")
STATE_KEYS = ("ee_states", "gripper_states")
STATE_DIMS = {"ee_states": 6, "gripper_states": 2}  # 6 + 2 = the 8-d policy state
LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
MEMORY_SUITE = "memory"
SUITES = (MEMORY_SUITE,) + LIBERO_SUITES
DEFAULT_DATA_ROOT = "data"  # gitignored
DEFAULT_CACHE_DIR = "data_cache"  # gitignored

LIBERO_HOWTO = (
    "Get the LIBERO datasets with the LIBERO repo's downloader (github.com/Lifelong-Robot-Learning/LIBERO): "
    "`python benchmark_scripts/download_libero_datasets.py --datasets {dl} --use-huggingface` (libero_10 and "
    "libero_90 both come in libero_100), then pass its download folder as the data root. Expected layout: "
    "<data_root>/<suite>/<task name>_demo.hdf5, suites: " + ", ".join(LIBERO_SUITES)
    + ". The embedded suite needs no download: `python data.py --suite memory`.")


def _howto(suite):
    return LIBERO_HOWTO.format(dl="libero_100" if suite in ("libero_10", "libero_90") else suite)


class DataError(ValueError):
    """Bad input data; the message names the file and the key."""


# ----------------------------------------------------------------------------------------------------------
# Raw observation -> policy inputs
# ----------------------------------------------------------------------------------------------------------

def policy_frame(obs):
    """Raw obs -> (images: dict cam -> uint8 [..., H, W, 3] upright, state float32 [..., 8]).

    Works on one frame ([H,W,3] images, [6]/[2] states) and on stacks ([T,H,W,3], [T,6]/[T,2]) alike: the 180
    degree rotation is `img[::-1, ::-1]` on the two image axes (LIBERO stores and renders upside down).
    """
    for k in CAMERAS + STATE_KEYS:
        if k not in obs:
            raise DataError(f"observation is missing key '{k}' (has {sorted(obs)}); expected {CAMERAS + STATE_KEYS}")
    images = {c: np.ascontiguousarray(np.asarray(obs[c])[..., ::-1, ::-1, :]) for c in CAMERAS}  # [...,H,W,3]
    return images, policy_state(obs)


def policy_state(obs):
    """ee_states [..., 6] + gripper_states [..., 2] -> float32 [..., 8] (what the simulator gives at eval)."""
    return np.concatenate([np.asarray(obs[k], dtype=np.float32) for k in STATE_KEYS], axis=-1)  # [..., 8]


# ----------------------------------------------------------------------------------------------------------
# Demo files (LIBERO layout; the embedded suite writes the same layout)
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Demo:
    name: str  # "demo_<i>"
    images: dict  # cam -> uint8 [T, H, W, 3] upright (empty dict when read with images=False)
    state: np.ndarray  # float32 [T, 8] = ee_states + gripper_states
    actions: np.ndarray  # float32 [T, Da]


def find_demo_files(data_root, suite, generate=True, **memory_kwargs):
    """Sorted list of `<data_root>/<suite>/*_demo.hdf5`. For suite 'memory' (and generate=True) missing files are
    generated first (generate_memory_suite(**memory_kwargs)); for LIBERO suites a missing folder is an error
    that says how to download them."""
    if suite not in SUITES:
        raise DataError(f"unknown suite '{suite}'; choose one of {SUITES}")
    folder = Path(data_root) / suite
    if suite == MEMORY_SUITE and generate:
        generate_memory_suite(data_root, **memory_kwargs)
    hint = "Run `python data.py --suite memory`." if suite == MEMORY_SUITE else _howto(suite)
    if not folder.is_dir():
        raise DataError(f"data directory {folder} does not exist. {hint}")
    files = sorted(folder.glob("*_demo.hdf5"))
    if not files:
        raise DataError(f"no *_demo.hdf5 files in {folder}. {hint}")
    return files


def instruction_from_filename(path):
    """`LIVING_ROOM_SCENE2_put_the_bowl_demo.hdf5` -> 'put the bowl' (scene prefix and _demo suffix stripped)."""
    stem = Path(path).name[: -len("_demo.hdf5")] if Path(path).name.endswith("_demo.hdf5") else Path(path).stem
    stem = re.sub(r"^.*?SCENE\d+_", "", stem)
    return stem.replace("_", " ").strip()


def _instruction(f, path):
    info = f["data"].attrs.get("problem_info")
    if info is None:
        instr = instruction_from_filename(path)
        warnings.warn(f"{path}: data.attrs['problem_info'] missing; instruction taken from the file name: '{instr}'")
        return instr
    try:
        instr = json.loads(info)["language_instruction"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: data.attrs['problem_info'] is not JSON with 'language_instruction' ({e!r})")
    if isinstance(instr, (list, tuple)) and all(isinstance(w, str) for w in instr):  # some exports: a list of words
        instr = " ".join(instr)
    if not isinstance(instr, str) or not instr.strip():
        raise DataError(f"{path}: data.attrs['problem_info']['language_instruction'] must be a non-empty string "
                        f"(or a list of words), got {instr!r}")
    return instr.strip()


def _demo_names(f, path):
    if not isinstance(f.get("data"), h5py.Group):
        raise DataError(f"{path}: no 'data' group (keys: {list(f.keys())}); not a LIBERO-layout demo file")
    names = [k for k, g in f["data"].items() if re.fullmatch(r"demo_\d+", k) and isinstance(g, h5py.Group)]
    if not names:
        raise DataError(f"{path}: 'data' holds no demo_<i> groups (keys: {list(f['data'].keys())[:10]})")
    other = [k for k in f["data"].keys() if k not in names]
    if other:  # LIBERO's 'data' holds demo_<i> groups only: say what is not read
        warnings.warn(f"{path}: data/{other[:10]} are not demo_<i> groups and are not read")
    return sorted(names, key=lambda k: int(k.split("_")[1]))


def _read_demo(f, path, name, images=True):
    """Validated Demo from an open h5py file. Every problem raises DataError naming file and key."""
    g = f["data"][name]
    need = ["actions"] + [f"obs/{k}" for k in STATE_KEYS] + ([f"obs/{c}" for c in CAMERAS] if images else [])
    for k in need:
        if not isinstance(g.get(k), h5py.Dataset):
            raise DataError(f"{path}: data/{name}/{k} is missing" + (" (a group, not an array)" if k in g else ""))
    arrays = {"actions": g["actions"][()]}
    for k in STATE_KEYS:
        arrays[f"obs/{k}"] = g[f"obs/{k}"][()]
    lengths = {k: a.shape[0] if a.ndim else -1 for k, a in arrays.items()}
    if images:
        for c in CAMERAS:
            ds = g[f"obs/{c}"]
            if ds.ndim != 4 or ds.shape[-1] != 3 or ds.dtype != np.uint8 or 0 in ds.shape[1:3]:
                raise DataError(f"{path}: data/{name}/obs/{c} must be uint8 [T,H,W,3], got {ds.dtype} {ds.shape}")
            lengths[f"obs/{c}"] = ds.shape[0]
        sizes = {c: g[f"obs/{c}"].shape[1:3] for c in CAMERAS}
        if len(set(sizes.values())) != 1:  # the tower encodes all cameras of a frame as one batch
            raise DataError(f"{path}: data/{name}: the cameras' images differ in size {sizes}")
    act = arrays["actions"]
    if act.ndim != 2 or act.shape[1] == 0:
        raise DataError(f"{path}: data/{name}/actions must be [T, Da] with Da >= 1, got shape {act.shape}")
    for k in STATE_KEYS:
        a = arrays[f"obs/{k}"]
        if a.ndim != 2 or a.shape[1] != STATE_DIMS[k]:
            raise DataError(f"{path}: data/{name}/obs/{k} must be [T, {STATE_DIMS[k]}], got shape {a.shape}")
    if len(set(lengths.values())) != 1:
        raise DataError(f"{path}: data/{name} has mismatched lengths {lengths}")
    if act.shape[0] == 0:
        raise DataError(f"{path}: data/{name} is empty (T = 0)")
    for k, a in arrays.items():
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(a.astype(np.float32))  # as training reads it: float64 beyond 3.4e38 becomes inf
        if bad.any():
            raise DataError(f"{path}: data/{name}/{k} has NaN/inf or values beyond float32's range "
                            f"(first at frame {np.argwhere(bad)[0][0]})")
    raw = {k: arrays[f"obs/{k}"] for k in STATE_KEYS}
    if images:
        # stored upside down -> upright, the same rotation eval.py applies to live frames
        imgs, state = policy_frame({**raw, **{c: g[f"obs/{c}"][()] for c in CAMERAS}})  # [T,H,W,3], [T,8]
    else:
        imgs, state = {}, policy_state(raw)  # [T, 8]
    return Demo(name=name, images=imgs, state=state, actions=act.astype(np.float32))


def open_demo_file(path):
    """The demo file, open read-only; a missing file or one that is not HDF5 is a DataError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"demo file {path} does not exist")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path}: cannot open as HDF5 ({e})") from e


def iter_demo_file(path, images=True):
    """(instruction, generator of Demo) - reads one demo at a time (a LIBERO file holds ~1 GB of pixels)."""
    path = Path(path)
    f = open_demo_file(path)
    try:
        names = _demo_names(f, path)
        instruction = _instruction(f, path)
    except BaseException:
        f.close()
        raise

    def gen():
        with f:
            for n in names:
                yield _read_demo(f, path, n, images)
    return instruction, gen()


def read_demo_file(path, images=True):
    """(instruction: str, demos: list[Demo]), fully validated."""
    instruction, demos = iter_demo_file(path, images)
    return instruction, list(demos)


def demo_lengths(path):
    """{demo name: T} from the actions shapes (no pixel reads)."""
    with open_demo_file(path) as f:
        acts = {n: f["data"][n].get("actions") for n in _demo_names(f, path)}
        return {n: a.shape[0] if isinstance(a, h5py.Dataset) and a.ndim else None for n, a in acts.items()}


def frame_size(path):
    """(H, W) of the camera images of a demo file (no pixel reads): every demo's cameras must have that size, since
    eval.py renders the simulator at the size the policy was trained on."""
    with open_demo_file(path) as f:
        sizes = {}  # (H, W) -> the first key that has it
        for name in _demo_names(f, path):
            for c in CAMERAS:
                ds = f["data"][name].get(f"obs/{c}")
                if not isinstance(ds, h5py.Dataset):
                    raise DataError(f"{path}: data/{name}/obs/{c} is missing")
                sizes.setdefault(tuple(int(x) for x in ds.shape[1:3]), f"data/{name}/obs/{c}")
        if len(sizes) > 1:
            raise DataError(f"{path}: the camera images differ in size: {sizes}")
        return next(iter(sizes))


def write_demo_file(path, instruction, episodes, env_name="", attrs=None):
    """Write episodes in LIBERO's layout. episodes: list of dicts with raw (upside-down) obs stacks
    agentview_rgb/eye_in_hand_rgb [T,H,W,3] uint8, ee_states [T,6], gripper_states [T,2], actions [T,Da],
    success (bool). Images are lzf-compressed (flat-colour renders shrink ~20x; LIBERO's own are plain)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        d = f.create_group("data")
        d.attrs["problem_info"] = json.dumps({"language_instruction": instruction})
        d.attrs["env_name"] = env_name
        d.attrs["macros_image_convention"] = "opengl"
        for k, v in (attrs or {}).items():
            d.attrs[k] = v
        total = 0
        for i, ep in enumerate(episodes):
            g = d.create_group(f"demo_{i}")
            T = len(ep["actions"])
            g.attrs["num_samples"] = T
            g.create_dataset("actions", data=np.asarray(ep["actions"], np.float64))  # [T, Da]
            for c in CAMERAS:
                g.create_dataset(f"obs/{c}", data=ep[c], compression="lzf", chunks=(1,) + ep[c].shape[1:])
            g.create_dataset("obs/ee_states", data=np.asarray(ep["ee_states"], np.float64))  # [T, 6]
            g.create_dataset("obs/gripper_states", data=np.asarray(ep["gripper_states"], np.float64))  # [T, 2]
            g.create_dataset("obs/joint_states", data=np.zeros((T, 7)))  # schema filler: no joints here
            rewards = np.zeros(T, np.uint8)
            rewards[-1] = int(ep.get("success", True))
            g.create_dataset("rewards", data=rewards)
            g.create_dataset("dones", data=rewards.copy())
            total += T
        d.attrs["num_demos"] = len(episodes)
        d.attrs["total"] = total
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written demo file behind


# ----------------------------------------------------------------------------------------------------------
# Normalisation statistics (saved with the checkpoint; eval un-normalises actions with the same numbers)
# ----------------------------------------------------------------------------------------------------------

def compute_stats(states, actions, min_std=1e-2):
    """Per-dimension mean/std over all frames. states: list of [T,8], actions: list of [T,Da].
    std is floored at min_std so constant dims (zero-filled state dims, binary gripper) stay finite.
    Returns numpy float32 arrays; use stats_to_torch() before torch.save (weights_only loads reject numpy)."""
    s = np.concatenate([np.asarray(x, np.float64) for x in states], 0)  # [N, 8]
    a = np.concatenate([np.asarray(x, np.float64) for x in actions], 0)  # [N, Da]
    return {"state_mean": s.mean(0).astype(np.float32), "state_std": np.maximum(s.std(0), min_std).astype(np.float32),
            "action_mean": a.mean(0).astype(np.float32), "action_std": np.maximum(a.std(0), min_std).astype(np.float32)}


def stats_to_torch(stats):
    return {k: torch.as_tensor(np.asarray(v), dtype=torch.float32) for k, v in stats.items()}


def stats_to_numpy(stats):
    return {k: (v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v)).astype(np.float32)
            for k, v in stats.items()}


def _like(v, x):
    return torch.as_tensor(v, dtype=x.dtype, device=x.device) if torch.is_tensor(x) else np.asarray(v, x.dtype)


def normalize(x, stats, kind):
    """(x - mean) / std over the last dim; kind 'state' or 'action'; numpy or torch."""
    return (x - _like(stats[f"{kind}_mean"], x)) / _like(stats[f"{kind}_std"], x)


def unnormalize(x, stats, kind):
    return x * _like(stats[f"{kind}_std"], x) + _like(stats[f"{kind}_mean"], x)


# ----------------------------------------------------------------------------------------------------------
# Frozen-feature cache: the vision tower is frozen, so every frame is encoded once (float16 on disk)
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Episode:
    """One demo as training sees it: tokens (lazy memmap view from the cache, or in-memory), raw state/actions."""
    tokens: np.ndarray  # float16 [T, n_tok, D]
    state: np.ndarray  # float32 [T, 8] (raw, not normalised)
    actions: np.ndarray  # float32 [T, Da] (raw)
    instruction: str
    source: str  # "<file>:<demo name>"


def file_identity(path):
    """What the cache trusts a source file by: resolved path, size and mtime (ns)."""
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_key_for(backbone, img_size, **extra):
    """cache_key convention: backbone name + the image size the tower sees (+ anything else that changes tokens)."""
    return "_".join([backbone, f"{img_size}px"] + [f"{k}={v}" for k, v in sorted(extra.items())])


def _slug(s):
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", s)[:120]


def _encode_file(path, encode_fn, batch_size, bar, out=None):
    """Encode all frames of one file. Writes into `out(n_total, n_tok, D)`-created array if given (the on-disk
    memmap), else keeps float16 arrays in memory. Returns (instruction, meta per demo, state/actions lists, tokens)."""
    lengths = demo_lengths(path)
    total = sum(v or 0 for v in lengths.values())
    instruction, demos = iter_demo_file(path, images=True)
    metas, states, actions, chunks, buf, off = [], [], [], [], None, 0
    for demo in demos:
        T = len(demo.actions)
        for s in range(0, T, batch_size):
            imgs = {c: torch.from_numpy(demo.images[c][s:s + batch_size]) for c in CAMERAS}  # uint8 [b,H,W,3]
            with torch.inference_mode():
                tok = encode_fn(imgs)  # [b, n_tok, D]
            tok = (tok.detach().float().cpu().numpy() if torch.is_tensor(tok) else np.asarray(tok)).astype(np.float16)
            if tok.ndim != 3 or tok.shape[0] != imgs[CAMERAS[0]].shape[0]:
                raise ValueError(f"encode_fn must return [B, n_tokens, D] for B={imgs[CAMERAS[0]].shape[0]} "
                                 f"frames, got shape {tok.shape}")
            if out is not None:
                if buf is None:
                    buf = out(total, *tok.shape[1:])  # [N_total, n_tok, D] float16 memmap
                buf[off + s: off + s + len(tok)] = tok
            else:
                chunks.append(tok)
            bar.update(len(tok))
        metas.append({"name": demo.name, "offset": off, "length": T})
        states.append(demo.state)
        actions.append(demo.actions)
        off += T
    tokens = buf if out is not None else np.concatenate(chunks, 0)  # [N_total, n_tok, D]
    return instruction, metas, states, actions, tokens


def _episodes(path, instruction, metas, states, actions, tokens):
    return [Episode(tokens=tokens[m["offset"]: m["offset"] + m["length"]], state=s, actions=a,
                    instruction=instruction, source=f"{path}:{m['name']}")
            for m, s, a in zip(metas, states, actions)]


def build_feature_cache(files, encode_fn, cache_key, cache_dir=DEFAULT_CACHE_DIR, batch_size=64, use_cache=True,
                        progress=True):
    """Encode every frame of every demo file once; return list[Episode] (tokens lazily memmapped from disk).

    encode_fn(images: dict cam -> uint8 tensor [B,H,W,3] upright, CPU) -> float tensor [B, n_tokens, D]; it is
    called under torch.inference_mode and should move the batch to its own device.
    Cache entry per source file: <cache_dir>/<cache_key>/<stem>-<hash(key, path, size, mtime)>/ with
    tokens.npy (float16 [N_frames, n_tok, D]), state.npy, actions.npy, meta.json (written last = complete).
    A changed source file gets a new entry (its stale one is deleted); use_cache=False encodes in memory only.
    """
    files = [Path(p) for p in files]
    root = Path(cache_dir) / _slug(cache_key)
    todo, episodes = [], {}
    for p in files:
        if not p.is_file():
            raise DataError(f"demo file {p} does not exist")
        ident = file_identity(p)
        digest = hashlib.sha1(json.dumps([cache_key, ident], sort_keys=True).encode()).hexdigest()[:16]
        entry = root / f"{p.stem}-{digest}"
        if use_cache and (entry / "meta.json").is_file():
            try:  # a complete entry damaged afterwards (disk full, a partial copy): say which, do not guess
                meta = json.loads((entry / "meta.json").read_text())
                tokens = np.load(entry / "tokens.npy", mmap_mode="r")  # [N, n_tok, D] float16, lazy
                st, ac = np.load(entry / "state.npy"), np.load(entry / "actions.npy")  # [N, 8], [N, Da]
                n = sum(m["length"] for m in meta["demos"])
                if not len(tokens) == len(st) == len(ac) == n:
                    raise ValueError(f"{len(tokens)} token, {len(st)} state, {len(ac)} action rows for {n} frames")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise DataError(f"feature cache entry {entry} is damaged ({type(e).__name__}: {e}); delete that "
                                f"folder and {p} is encoded again") from e
            episodes[p] = _episodes(p, meta["instruction"], meta["demos"],
                                    [st[m["offset"]: m["offset"] + m["length"]] for m in meta["demos"]],
                                    [ac[m["offset"]: m["offset"] + m["length"]] for m in meta["demos"]], tokens)
        else:
            todo.append((p, ident, entry))
    if todo:
        total = sum(sum(v or 0 for v in demo_lengths(p).values()) for p, _, _ in todo)
        with tqdm(total=total, desc=f"encoding frames ({cache_key})", unit="frame", disable=not progress) as bar:
            for p, ident, entry in todo:
                if not use_cache:
                    episodes[p] = _episodes(p, *_encode_file(p, encode_fn, batch_size, bar))
                    continue
                tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                out = lambda *shape: np.lib.format.open_memmap(tmp / "tokens.npy", "w+", np.float16, shape)
                try:
                    instr, metas, st, ac, tok = _encode_file(p, encode_fn, batch_size, bar, out)
                    tok.flush()
                    del tok
                    np.save(tmp / "state.npy", np.concatenate(st, 0))
                    np.save(tmp / "actions.npy", np.concatenate(ac, 0))
                    (tmp / "meta.json").write_text(json.dumps({"instruction": instr, "demos": metas,
                                                               "source": ident, "cache_key": cache_key}))
                except BaseException:  # bad data or Ctrl-C: no half-written entry left behind (GBs for LIBERO)
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                for old in root.glob(f"{p.stem}-*"):  # stale entries of this same source file
                    if old == entry or ".tmp" in old.name:  # (entry: another process just finished it)
                        continue
                    try:
                        if json.loads((old / "meta.json").read_text())["source"]["path"] == ident["path"]:
                            shutil.rmtree(old)
                    except (OSError, ValueError, KeyError):
                        pass
                try:
                    os.replace(tmp, entry)
                except OSError:  # another process finished the same entry first: use theirs
                    if not (entry / "meta.json").is_file():
                        raise
                    shutil.rmtree(tmp, ignore_errors=True)
                tokens = np.load(entry / "tokens.npy", mmap_mode="r")
                episodes[p] = _episodes(p, instr, metas, st, ac, tokens)
    return [e for p in files for e in episodes[p]]


# ----------------------------------------------------------------------------------------------------------
# Training data + streaming TBPTT sampler (Sec. 3.4 "Recurrent unrolling")
# ----------------------------------------------------------------------------------------------------------

class FrameData:
    """Episodes ready for training: tokens (lazy), normalised state [T,8] and actions [T,Da], instruction ids.
    stats=None computes them from these (training) episodes; pass the checkpoint's stats when resuming."""

    def __init__(self, episodes, stats=None, vocab=None):
        if not episodes:
            raise DataError("FrameData got no episodes")
        e0 = episodes[0]
        for e in episodes:  # one action space and one token layout for the whole training set
            if e.actions.shape[1:] != e0.actions.shape[1:] or e.tokens.shape[1:] != e0.tokens.shape[1:]:
                raise DataError(f"{e.source}: actions {e.actions.shape[1:]} / tokens {e.tokens.shape[1:]} differ "
                                f"from {e0.source}: {e0.actions.shape[1:]} / {e0.tokens.shape[1:]}")
        self.episodes = episodes
        self.stats = stats_to_numpy(stats) if stats is not None else compute_stats(
            [e.state for e in episodes], [e.actions for e in episodes])
        self.vocab = list(vocab) if vocab is not None else sorted({e.instruction for e in episodes})
        missing = sorted({e.instruction for e in episodes} - set(self.vocab))
        if missing:
            raise DataError(f"instructions not in the given vocab: {missing[:5]}")
        ids = {s: i for i, s in enumerate(self.vocab)}
        self.state = [normalize(e.state.astype(np.float32), self.stats, "state") for e in episodes]  # [T, 8]
        self.actions = [normalize(e.actions.astype(np.float32), self.stats, "action") for e in episodes]  # [T, Da]
        self.instr = np.array([ids[e.instruction] for e in episodes], np.int64)
        self.lengths = np.array([len(e.actions) for e in episodes], np.int64)
        self.token_shape = tuple(episodes[0].tokens.shape[1:])  # (n_tok, D)
        self.action_dim = self.actions[0].shape[1]

    def __len__(self):
        return len(self.episodes)

    def batch(self, window, chunk=None, device="cpu"):
        """Materialise one StreamSampler window. Returns dict of tensors:
        tokens [B,T,n_tok,D] float32, state [B,T,8], actions [B,T,C,Da] (a_{t:t+C-1}, padded with the last action),
        action_mask [B,T,C] bool (False past the episode end), frame_valid [B,T] bool, reset [B] bool, instr [B]."""
        ep, start = window["episode"], window["start"]
        B, T, C = len(ep), window["window"], window["chunk"] if chunk is None else chunk
        tok = np.empty((B, T) + self.token_shape, np.float32)  # [B, T, n_tok, D]
        state = np.empty((B, T, self.state[0].shape[1]), np.float32)  # [B, T, 8]
        act = np.empty((B, T, C, self.action_dim), np.float32)  # [B, T, C, Da]
        amask = np.empty((B, T, C), bool)
        valid = np.empty((B, T), bool)
        for b in range(B):
            e, t0 = int(ep[b]), int(start[b])
            L = int(self.lengths[e])
            t = t0 + np.arange(T)  # [T] absolute frame index
            valid[b] = t < L
            tc = np.minimum(t, L - 1)  # frames past the end repeat the last one (masked out anyway)
            n = min(T, L - t0)
            tok[b, :n] = self.episodes[e].tokens[t0:t0 + n]  # one contiguous (memmap) read
            tok[b, n:] = tok[b, n - 1]
            state[b] = self.state[e][tc]
            ci = t[:, None] + np.arange(C)[None, :]  # [T, C] indices of a_{t:t+C-1}
            amask[b] = (ci < L) & valid[b][:, None]
            act[b] = self.actions[e][np.minimum(ci, L - 1)]  # [T, C, Da]
        out = dict(tokens=tok, state=state, actions=act, action_mask=amask, frame_valid=valid,
                   reset=np.asarray(window["reset"], bool), instr=self.instr[np.asarray(ep)])
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in out.items()}


class StreamSampler:
    """B parallel streams; each walks whole episodes front to back in consecutive windows of T frames.

    next_window() -> dict(episode [B], start [B], reset [B] bool, window=T, chunk=C, epoch). reset[b] is True
    exactly when stream b's window is the first of a new episode: the trainer zeros that stream's memory rows
    there and otherwise carries them over (detached) from the previous window, so late frames are trained with
    long histories as at deployment. A stream that finishes an episode takes the next one from a shared queue:
    a permutation of all episodes drawn per epoch from (seed, epoch), so the whole sequence is deterministic
    under the seed, and state_dict() resumes it exactly. Windows never straddle two episodes (frames past the
    end are marked invalid by FrameData.batch).
    """

    def __init__(self, episode_lengths, batch_size, window, chunk=1, seed=0, shuffle=True):
        self.lengths = np.asarray(episode_lengths, np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0 or (self.lengths <= 0).any():
            raise ValueError(f"episode_lengths must be a non-empty list of positive ints, got {episode_lengths}")
        if batch_size < 1 or window < 1 or chunk < 1:
            raise ValueError(f"batch_size, window, chunk must be >= 1 (got {batch_size}, {window}, {chunk})")
        self.B, self.T, self.C, self.seed, self.shuffle = batch_size, window, chunk, seed, shuffle
        self.epoch, self.pos = 0, 0  # epoch of the queue and position in its permutation
        self.ep = np.full(batch_size, -1, np.int64)  # [B] current episode per stream (-1: none yet)
        self.next_t = np.zeros(batch_size, np.int64)  # [B] start frame of each stream's next window
        self._order_cache = None

    def order(self, epoch):
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.lengths)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    def windows_per_epoch(self):
        return math.ceil(int(np.ceil(self.lengths / self.T).sum()) / self.B)

    def _take(self):
        if self.pos >= len(self.lengths):
            self.epoch, self.pos = self.epoch + 1, 0
        e = int(self.order(self.epoch)[self.pos])
        self.pos += 1
        return e

    def next_window(self):
        reset = np.zeros(self.B, bool)
        for b in range(self.B):  # ascending b: deterministic hand-out order
            if self.ep[b] < 0 or self.next_t[b] >= self.lengths[self.ep[b]]:
                self.ep[b], self.next_t[b], reset[b] = self._take(), 0, True
        win = dict(episode=self.ep.copy(), start=self.next_t.copy(), reset=reset, window=self.T, chunk=self.C,
                   epoch=self.epoch)
        self.next_t += self.T
        return win

    def __iter__(self):
        while True:
            yield self.next_window()

    def state_dict(self):
        return dict(seed=self.seed, shuffle=self.shuffle, B=self.B, T=self.T, n_episodes=len(self.lengths),
                    lengths_sha=hashlib.sha1(self.lengths.tobytes()).hexdigest(), epoch=self.epoch, pos=self.pos,
                    ep=self.ep.tolist(), next_t=self.next_t.tolist())

    def load_state_dict(self, sd):
        mine = self.state_dict()
        for k in ("seed", "shuffle", "B", "T", "n_episodes", "lengths_sha"):
            if sd[k] != mine[k]:
                raise ValueError(f"sampler state does not match this run: {k} = {sd[k]} in the checkpoint, "
                                 f"{mine[k]} now (same data, batch size, window and seed are needed to resume)")
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
        self.ep, self.next_t = np.array(sd["ep"], np.int64), np.array(sd["next_t"], np.int64)


# ----------------------------------------------------------------------------------------------------------
# Embedded memory suite: procedurally generated 2-D tasks that the current frame alone cannot solve
# ----------------------------------------------------------------------------------------------------------
#
# World: the unit square seen from above. The agent (white disc) moves with action [vx, vy, press] in [-1,1]^3:
# displacement = SPEED * clip(v) per step, press > 0 is a button press. Objects (big coloured squares) sit near
# the centres of a 4x4 grid (randomised cells + jitter), which matches a 16-pixel ViT patch grid at 64 px.
# Views: agentview_rgb = the whole table; eye_in_hand_rgb = a 2x zoom centred on the agent (black off-table).
# Expert (expert_action): straight to the goal at EXPERT_GAIN of the max speed, DART noise on the executed action.
# On pad tasks it presses through: after the touch registers (TOUCH_R) it goes on to the target's centre
# (REACH_R) before heading home, like a person pressing a button firmly rather than grazing it. Turning back at the
# very edge of the touch radius taught policies to turn back a little early (README, embedded-suite results).
# State (8-d, STATE_KEYS): ee_states = [x, y, 0, 0, 0, 0] (no height/orientation here: zero-filled),
# gripper_states = [0, 0] (no gripper: zero-filled). So the state never reveals counts, stages or cues.
#
# MEMORYLESS_CEILING: best success of any policy that picks each action from the current observation only
# (execution horizon 1; an open-loop action chunk of h steps is itself h steps of memory - see each family for
# the largest h the bound still covers). Layouts are independent of the hidden variable in every task.
#  - cue_*: the cue shows only in frames 0-1, the agent is frozen for the first FREEZE_STEPS=8 steps, so the
#    first frame in which it can move is the same whatever the cue: the trajectory distribution (hence which
#    of the K targets is touched first; a wrong touch ends the episode) is cue-independent -> at best 1/K.
#    Covers open-loop horizons h <= FREEZE_STEPS - CUE_STEPS + 1 = 7.
#  - round_trip_* / count_*: the agent starts on the home pad, and entering the pad snaps it to the pad centre,
#    so every visit of the pad starts from one identical observation (the touched target and the button look
#    the same as before). Pressing on the pad ends the episode: success iff the target was touched exactly n
#    times (a touch counts once per trip: the target re-arms on the pad). From the pad centre a memoryless
#    policy finishes with some probability 1-x (x: it does one more counted trip first; trips without a touch
#    are wasted time), the same at every visit, so P(success) <= x^n (1-x) <= n^n / (n+1)^(n+1):
#    1/4 for the round trip (n = 1), 4/27 for n = 2, 27/256 for n = 3. With open-loop chunks the bound holds
#    when the policy re-plans on reaching the pad; a chunk running across the pad could carry information from
#    the end of the previous trip, so evaluate memoryless baselines with a short execution horizon.

# Cue tasks are counterbalanced: every training layout is shown with each of its K cues, so that in the
# demonstrations the layout says nothing about the cue. With one random cue per layout (version 2) the 150 training
# layouts each had one right answer, which a policy can memorise without memory: the memoryless baseline reached
# 45 % on cue_location's training layouts (ceiling 33 %), and a DRAM policy 87.5 % there against 60 % on new
# layouts (README, embedded-suite results).
MEMORY_SUITE_VERSION = 3  # bump when layouts, rendering or the expert change (older files are then refused)
MEMORY_EPISODES = 150  # demos per task (cue tasks: 50 layouts x 3 cues); with 50 demos per task the policies
# generalised clearly worse to unseen layouts (README)
SPEED = 0.08  # max displacement per step and axis (table = unit square)
GRID = 4  # object cells per side
AGENT_R, OBJ_HALF, TOUCH_R, HOME_R, REACH_R = 0.05, 0.075, 0.09, 0.09, 0.03
CUE_STEPS, FREEZE_STEPS = 2, 8
EXPERT_GAIN, EXPERT_NOISE = 0.8, 0.15  # cruise at 80% of max speed; DART-style executed-action noise
COLOURS = dict(red=(225, 45, 45), green=(45, 200, 60), blue=(50, 90, 235), yellow=(235, 210, 40),
               grey=(140, 140, 140), white=(245, 245, 245), floor=(55, 55, 60), home=(110, 110, 125))

MEMORY_TASKS = {
    # name: (family, instruction, params)
    "cue_colour": ("cue", "remember the colour flashed at the start and touch the block of that colour",
                   dict(cue="colour", k=3)),
    "cue_location": ("cue", "remember which block lights up at the start and touch it", dict(cue="location", k=3)),
    "round_trip_red": ("pad", "touch the red block, come back to the home pad and press it",
                       dict(target="red", distractor="blue", n=1)),
    "round_trip_blue": ("pad", "touch the blue block, come back to the home pad and press it",
                        dict(target="blue", distractor="red", n=1)),
    "count_2": ("pad", "press the yellow button twice, returning to the home pad after each press, then press the pad",
                dict(target="yellow", distractor=None, n=2)),
    "count_3": ("pad", "press the yellow button three times, returning to the home pad after each press, "
                       "then press the pad", dict(target="yellow", distractor=None, n=3)),
}
MEMORYLESS_CEILING = {"cue_colour": 1 / 3, "cue_location": 1 / 3, "round_trip_red": 1 / 4, "round_trip_blue": 1 / 4,
                      "count_2": 4 / 27, "count_3": 27 / 256}
FAILURES = ("timeout", "wrong_block", "distractor", "pad_press", "over_count")  # MemoryEnv.outcome of a failure
MAX_STEPS = {"cue_colour": 40, "cue_location": 40, "round_trip_red": 50, "round_trip_blue": 50,
             "count_2": 70, "count_3": 100}


def _seg_dist(p, a, b):
    """Distance from point p to segment ab."""
    ab, ap = b - a, p - a
    u = np.clip(ap @ ab / max(ab @ ab, 1e-12), 0.0, 1.0)
    return float(np.linalg.norm(ap - u * ab))


class MemoryEnv:
    """One embedded task. reset(seed=None) -> raw obs; step(action [3]) -> (obs, success: bool, done: bool).
    done is True on success, failure (wrong touch / wrong count) or at max_steps; `outcome` then says which (None
    while the episode runs): "success", "timeout", a cue task's "wrong_block", a pad task's "distractor",
    "over_count" (touched the target more than n times) or "pad_press" (pressed the pad after fewer than n touches);
    `count` is the number of target touches so far. Obs keys = the shared raw format (images upside down like
    LIBERO). expert_action() is the scripted expert (privileged, noise-free)."""

    def __init__(self, task, seed=0, img_size=64):
        if task not in MEMORY_TASKS:
            raise ValueError(f"unknown memory task '{task}'; choose one of {list(MEMORY_TASKS)}")
        self.task, self.img_size = task, img_size
        self.family, self.instruction, self.p = MEMORY_TASKS[task]
        self.max_steps = MAX_STEPS[task]
        self.rng = np.random.default_rng(seed)
        g = (np.arange(img_size) + 0.5) / img_size  # pixel centres in [0, 1]
        self._gx, self._gy = np.meshgrid(g, 1.0 - g)  # [S, S] world x / y of each upright pixel (row 0 = top)

    # -- layout --------------------------------------------------------------------------------------------
    def _cells(self, n, rng):
        idx = rng.choice(GRID * GRID, n, replace=False)
        c = np.stack([idx % GRID, idx // GRID], 1) + 0.5  # [n, 2] cell centres in cell units
        return c / GRID + rng.uniform(-0.03, 0.03, (n, 2))  # [n, 2] world

    def reset(self, seed=None, cue=None):
        """New episode: layout (and cue) from `seed`; `cue` in [0, K) overrides the drawn cue of a cue task."""
        rng = self.rng if seed is None else np.random.default_rng(seed)
        for _ in range(1000):  # rejection sampling: expert paths must clear every other object
            if self.family == "cue":
                k = self.p["k"]
                pts = self._cells(k + 1, rng)
                start, objs = pts[0], pts[1:]
                ok = all(np.linalg.norm(o - start) > 0.3 for o in objs) and all(
                    _seg_dist(objs[j], start, objs[i]) > TOUCH_R + 0.08
                    for i in range(k) for j in range(k) if i != j)
            else:
                n_obj = 2 if self.p["distractor"] else 1
                pts = self._cells(n_obj + 1, rng)
                start, objs = pts[0], pts[1:]
                d = np.linalg.norm(objs[0] - start)
                lo, hi = (0.35, 0.65) if self.p["n"] > 1 else (0.4, 0.85)
                ok = lo < d < hi and (n_obj == 1 or (_seg_dist(objs[1], start, objs[0]) > TOUCH_R + 0.08
                                                     and np.linalg.norm(objs[1] - start) > HOME_R + 0.1))
            if ok:
                break
        else:
            raise RuntimeError(f"{self.task}: could not sample a layout")
        self.pos, self.home, self.objs = start.copy(), start.copy(), objs
        self.cue = int(rng.integers(self.p["k"])) if self.family == "cue" else 0
        if cue is not None:
            if self.family != "cue":
                raise ValueError(f"{self.task}: cue={cue} given, but only the cue tasks have a cue")
            if not 0 <= cue < self.p["k"]:
                raise ValueError(f"{self.task}: cue={cue} out of range [0, {self.p['k']})")
            self.cue = int(cue)
        self.t, self.count, self.armed, self.in_home, self.done, self.success = 0, 0, True, True, False, False
        self.outcome = None
        self.reached = False  # reached the target's centre since the last touch (used by the expert only)
        return self._obs()

    # -- dynamics ------------------------------------------------------------------------------------------
    def step(self, action):
        if self.done:
            raise RuntimeError("step() after done; call reset()")
        a = np.clip(np.asarray(action, np.float64).reshape(-1)[:3], -1.0, 1.0)  # [3]
        if self.family == "cue":
            if self.t >= FREEZE_STEPS:  # frozen while the cue shows and during the delay after it
                self._move(a)
            hit = self._touched()
            if hit is not None:
                self.done, self.success = True, hit == self.cue
                self.outcome = "success" if self.success else "wrong_block"
        else:
            if a[2] > 0 and np.linalg.norm(self.pos - self.home) < HOME_R:  # press the pad = finish
                self.done, self.success = True, self.count == self.p["n"]
                self.outcome = "success" if self.success else "pad_press"
            else:
                self._move(a)
                inside = np.linalg.norm(self.pos - self.home) < HOME_R
                if inside and not self.in_home:  # entering the pad: snap to its centre, re-arm the target
                    self.pos, self.armed, self.reached = self.home.copy(), True, False
                self.in_home = inside
                hit = self._touched()
                if hit == 0 and self.armed:
                    self.count, self.armed = self.count + 1, False
                    if self.count > self.p["n"]:
                        self.done, self.outcome = True, "over_count"  # cannot succeed any more
                elif hit == 1:  # the distractor
                    self.done, self.outcome = True, "distractor"
                if not self.armed and np.linalg.norm(self.pos - self.objs[0]) < REACH_R:
                    self.reached = True  # (bookkeeping for the expert; no effect on the task)
        self.t += 1
        if self.t >= self.max_steps and not self.done:
            self.done, self.outcome = True, "timeout"
        return self._obs(), self.success, self.done

    def _move(self, a):
        self.pos = np.clip(self.pos + SPEED * a[:2], AGENT_R, 1 - AGENT_R)

    def _touched(self):
        d = np.linalg.norm(self.objs - self.pos, axis=1)  # [n_obj]
        return int(d.argmin()) if d.min() < TOUCH_R else None

    def expert_action(self):
        """Noise-free scripted expert: straight to the goal at EXPERT_GAIN speed, slowing down on arrival. On a pad
        task it presses the button through: it goes on to the target's centre (within REACH_R) after the touch
        registers, and only then heads home, so a policy that imitates it turns back with a margin of
        TOUCH_R - REACH_R inside the touch radius rather than at its edge."""
        press = -1.0
        if self.family == "cue":
            goal = self.objs[self.cue]
        elif (self.armed and self.count < self.p["n"]) or (not self.armed and not self.reached):
            goal = self.objs[0]
        else:
            goal = self.home
            if np.linalg.norm(self.pos - self.home) < 1e-9 and self.count == self.p["n"]:
                return np.array([0.0, 0.0, 1.0])  # back on the pad after n touches: press
        v = (goal - self.pos) / SPEED
        v = v * min(1.0, EXPERT_GAIN / max(np.abs(v).max(), 1e-9))  # per-axis speed <= EXPERT_GAIN
        return np.array([v[0], v[1], press])

    # -- rendering -----------------------------------------------------------------------------------------
    def _draw(self, gx, gy, img):
        """Draw the scene into img [S,S,3] (upright) given world coords gx, gy [S,S] of its pixels."""
        def square(c, half, col):
            img[(np.abs(gx - c[0]) < half) & (np.abs(gy - c[1]) < half)] = col
        cue_on = self.family == "cue" and self.t < CUE_STEPS
        if self.family == "cue":
            for i, o in enumerate(self.objs):
                if self.p["cue"] == "colour":
                    col = COLOURS[("red", "green", "blue", "yellow")[i]]
                else:
                    col = COLOURS["yellow"] if (cue_on and i == self.cue) else COLOURS["grey"]
                square(o, OBJ_HALF, col)
        else:
            square(self.home, HOME_R + 0.01, COLOURS["home"])
            square(self.objs[0], OBJ_HALF, COLOURS[self.p["target"]])
            if self.p["distractor"]:
                square(self.objs[1], OBJ_HALF, COLOURS[self.p["distractor"]])
        img[(gx - self.pos[0]) ** 2 + (gy - self.pos[1]) ** 2 < AGENT_R ** 2] = COLOURS["white"]
        if cue_on and self.p["cue"] == "colour":  # a thick frame in the cue colour
            b = 4 * self.img_size // 64
            col = COLOURS[("red", "green", "blue", "yellow")[self.cue]]
            img[:b], img[-b:], img[:, :b], img[:, -b:] = col, col, col, col
        return img

    def render(self):
        """Upright views: (agentview [S,S,3], eye_in_hand [S,S,3]) uint8."""
        S = self.img_size
        glob = np.empty((S, S, 3), np.uint8)
        glob[:] = COLOURS["floor"]
        self._draw(self._gx, self._gy, glob)
        ex, ey = self.pos[0] + (self._gx - 0.5) * 0.5, self.pos[1] + (self._gy - 0.5) * 0.5  # 2x zoom on agent
        ego = np.zeros((S, S, 3), np.uint8)
        ego[(ex > 0) & (ex < 1) & (ey > 0) & (ey < 1)] = COLOURS["floor"]
        self._draw(ex, ey, ego)
        return glob, ego

    def _obs(self):
        glob, ego = self.render()
        return {"agentview_rgb": glob[::-1, ::-1].copy(), "eye_in_hand_rgb": ego[::-1, ::-1].copy(),  # raw: upside down
                "ee_states": np.array([self.pos[0], self.pos[1], 0, 0, 0, 0], np.float64),
                "gripper_states": np.zeros(2, np.float64)}


def rollout_expert(env, seed, noise=EXPERT_NOISE, cue=None):
    """One expert episode (DART: executes action + noise, records the clean expert action).
    Returns dict of stacked raw obs [T,...], actions [T,3], success."""
    # one flat entropy list (numpy >= 2.5 rejects nested ones; older numpy flattened them to the same words)
    words = [int(x) for x in np.atleast_1d(seed)]
    rng = np.random.default_rng(words + [1 if cue is None else 2 + cue])
    obs, frames, acts = env.reset(seed=seed, cue=cue), [], []
    done, success = False, False
    while not done:
        a = env.expert_action()  # [3]
        frames.append(obs)
        acts.append(a)
        noisy = a.copy()
        noisy[:2] += noise * rng.standard_normal(2)  # (ignored by the env while a cue task is frozen)
        obs, success, done = env.step(noisy)
    ep = {k: np.stack([f[k] for f in frames]) for k in CAMERAS + STATE_KEYS}
    ep["actions"] = np.stack(acts).astype(np.float32)
    ep["success"] = success
    return ep


def generate_memory_suite(data_root=DEFAULT_DATA_ROOT, n_episodes=None, img_size=None, seed=0, tasks=None,
                          overwrite=False, progress=True):
    """Write <data_root>/memory/<task>_demo.hdf5 (LIBERO layout) for each task; existing files are kept unless
    overwrite. None accepts what an existing file has (n_episodes: MEMORY_EPISODES when generating; img_size: 64);
    an explicit value that differs from an existing file's, or a file written by an older generator
    (MEMORY_SUITE_VERSION), is an error that names the file and the command that regenerates it. Every demo is an
    expert success; a failed expert episode raises."""
    if n_episodes is not None and n_episodes < 1:
        raise ValueError(f"--episodes must be >= 1, got {n_episodes}")
    if img_size is not None and img_size < 16:  # the colour cue's frame is img_size / 16 pixels wide
        raise ValueError(f"--img-size must be >= 16, got {img_size}")
    if not 0 <= seed < 2 ** 32:
        raise ValueError(f"--seed must be in [0, 2**32), got {seed}")
    out = []
    for task in tasks or list(MEMORY_TASKS):
        if task not in MEMORY_TASKS:
            raise ValueError(f"unknown memory task '{task}'; choose from {list(MEMORY_TASKS)}")
        ti = list(MEMORY_TASKS).index(task)  # seeds do not depend on which subset is generated
        path = Path(data_root) / MEMORY_SUITE / f"{task}_demo.hdf5"
        out.append(path)
        if path.exists() and not overwrite:
            with open_demo_file(path) as f:
                attrs = dict(f["data"].attrs) if "data" in f else {}
                have = dict(img_size=attrs.get("img_size"), episodes=len(f["data"]) if "data" in f else None,
                            version=attrs.get("suite_version"))
            fix = (f"regenerate with `python data.py --suite memory --out {data_root} --overwrite"
                   f"{'' if n_episodes is None else f' --episodes {n_episodes}'}"
                   f"{'' if img_size is None else f' --img-size {img_size}'}` or use another data root")
            if have["version"] != MEMORY_SUITE_VERSION:
                raise DataError(f"{path} was written by an older version of the embedded suite (suite_version "
                                f"{have['version']}, this code writes {MEMORY_SUITE_VERSION}); {fix}")
            if img_size is not None and have["img_size"] is not None and int(have["img_size"]) != img_size:
                raise DataError(f"{path}: data.attrs['img_size'] = {have['img_size']} but img_size={img_size} was "
                                f"asked; {fix}")
            if n_episodes is not None and have["episodes"] != n_episodes:
                raise DataError(f"{path} holds {have['episodes']} demos but {n_episodes} were asked (--episodes); "
                                f"{fix}")
            continue
        n_gen = MEMORY_EPISODES if n_episodes is None else n_episodes
        size = 64 if img_size is None else img_size
        env = MemoryEnv(task, img_size=size)
        eps = []
        for i in tqdm(range(n_gen), desc=f"memory/{task}", disable=not progress, leave=False):
            layout, cue = [seed, ti, i], None
            if env.family == "cue":  # K consecutive demos share a layout, each with its own cue (MEMORY_SUITE_VERSION)
                layout, cue = [seed, ti, i // env.p["k"]], i % env.p["k"]
            ep = rollout_expert(env, seed=layout, cue=cue)
            if not ep["success"]:
                raise RuntimeError(f"scripted expert failed on {task} episode {i} (layout seed {layout}, cue {cue})")
            eps.append(ep)
        write_demo_file(path, env.instruction, eps, env_name=f"MemoryEnv/{task}",
                        attrs={"img_size": size, "seed": seed, "suite_version": MEMORY_SUITE_VERSION,
                               "memoryless_ceiling": MEMORYLESS_CEILING[task], "max_steps": env.max_steps})
    return out


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=MEMORY_SUITE, choices=SUITES)
    ap.add_argument("--out", "--data-root", dest="root", default=DEFAULT_DATA_ROOT, help="data root")
    ap.add_argument("--episodes", type=int, default=None, help=f"memory suite: demos per task (default "
                    f"{MEMORY_EPISODES})")
    ap.add_argument("--img-size", type=int, default=None, help="memory suite: rendered image size (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="memory suite: regenerate existing files")
    args = ap.parse_args(argv)
    if args.suite == MEMORY_SUITE:
        try:
            generate_memory_suite(args.root, args.episodes, args.img_size, args.seed, overwrite=args.overwrite)
        except DataError:
            raise
        except ValueError as e:  # a bad argument: a usage error naming it
            ap.error(str(e))
    files = find_demo_files(args.root, args.suite, generate=False)
    for p in files:  # full validation pass (pixels included), one summary line per task
        instr, demos = iter_demo_file(p)
        lens = [len(d.actions) for d in demos]
        print(f"{p.name}: {len(lens)} demos, T {min(lens)}-{max(lens)}, '{instr}'"
              + (f", memoryless ceiling {MEMORYLESS_CEILING[p.name[:-10]]:.3f}" if args.suite == MEMORY_SUITE else ""))


if __name__ == "__main__":
    main()

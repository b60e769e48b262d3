"""
DRAM: Delta-rule Recurrent Associative Memory, the paper's math in one file (torch only; DRAM-paper.tex).

Use it in your own model (a shared-source stack; X^Q = X^K = X^V = the N tokens of a frame):

    mem = DRAMStack(DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=4, head_dk=32, head_dv=32), depth=2)
    state = mem.init_state(B)                    # [B, L, H, dk, dv] fp32 zeros (S_0 = 0)
    y, state = mem(x, state, mask, frame_valid)  # training window: x [B, T, N, D] -> y [B, T, N, D]
    state = state.detach()                       # truncated BPTT: content crosses the window boundary, gradients stop
    y_t, state = mem.step(x_t, state)            # deployment: one frame x_t [B, N, D], one read-write transition
    state = mem.reset_state(state, starts)       # rows [B] bool whose episode starts: S <- 0

A fresh layer is the identity (f_O is zero-initialised): adding it leaves a frozen policy as it was.

Docstrings cite the paper's equation labels: eq. (read) is the paper's eq:read.
Shapes: B batch, T frames of a TBPTT window, M query tokens, N write tokens, H heads, dk / dv per-head dims.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- The functional core (leading dims `...` are batch / head dims and broadcast) --------------------------------
def write_weights(beta, pad_mask=None, cap=0.99):
    """eq. (write-gate): w = p b / (1 - b), b = min(beta, cap). The odds form makes the N = 1 joint write equal the
    gated delta rule with strength b (eq. app-single-token); the cap bounds w <= 99, so cond(A) <= 1 + 99 N."""
    b = beta.clamp(max=cap)
    w = b / (1.0 - b)
    return w if pad_mask is None else w * pad_mask.to(w.dtype)  # p_i = 0: no part in the Gram matrix nor the rhs


def read(Q, S):
    """eq. (read): R = Q S / sqrt(d_k). Q [..., M, dk], S [..., dk, dv] -> [..., M, dv]. Callers pass S_{t-1}."""
    return (Q @ S.to(Q.dtype)) / math.sqrt(Q.shape[-1])


def sequential_delta_write(S, K, V, beta, gamma):
    """Reference: the gated delta rule (eq. gated_delta_memory), token by token; retention once per frame, so N = 1
    equals the joint write, and for N > 1 the result depends on the token order (appendix, counterexample).
    S [..., dk, dv], K [..., N, dk] unit rows, V [..., N, dv], beta [..., N], gamma [...]."""
    S = gamma[..., None, None] * S
    for i in range(K.shape[-2]):
        k, v = K[..., i : i + 1, :], V[..., i : i + 1, :]  # [..., 1, dk], [..., 1, dv]
        S = S + beta[..., i, None, None] * k.mT @ (v - k @ S)  # S <- S + beta k^T (v - k S)
    return S


@contextmanager
def _exact_fp32():
    """True fp32 for the Gram matrix and the solve (appendix, forward solve): autocast, TF32, oneDNN's bf16 off. The
    legacy setter writes both of torch >= 2.9's precision APIs (cuBLAS refuses to run when they disagree)."""
    b = torch.backends
    new = hasattr(b.cuda.matmul, "fp32_precision") and (b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision)
    try:
        old = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 when only the new fields were set: restoring those restores all
        old = "highest"
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(old)
        if new:
            b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision = new


def _cholesky_solve(L, B):
    """A^{-1} B for A = L L^T by two triangular solves (torch.cholesky_solve's CUDA batch path cannot be graphed)."""
    return torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, B, upper=False), upper=True)


class _JointWrite(torch.autograd.Function):
    """T consecutive joint writes, eq. (correction), with the implicit-differentiation backward of the appendix.
    S0 [P, dk, dv], K [P, T, N, dk], V [P, T, N, dv], w [P, T, N], gamma [P, T] -> S_1..S_T [P, T, dk, dv].
    K^T W, A and its Cholesky factor do not depend on the state: all T frames at once; the recurrence frame by frame."""

    @staticmethod
    def forward(ctx, S0, K, V, w, gamma):
        KW = (K * w[..., None]).mT  # [P, T, dk, N]  K^T W
        A = KW @ K + torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)  # [P, T, dk, dk]  SPD, eq. (hessian-pd)
        L = torch.linalg.cholesky_ex(A).L  # A >= I, so the factorisation cannot fail: no error check (no GPU sync)
        S, states = S0, []
        for t in range(K.shape[1]):
            S_bar = gamma[:, t, None, None] * S  # eq. (retention): S_bar = gamma S_{t-1}
            rhs = KW[:, t] @ (V[:, t] - K[:, t] @ S_bar)  # [P, dk, dv]  K^T W (V - K S_bar), the residual form
            S = S_bar + _cholesky_solve(L[:, t], rhs)  # eq. (correction): S_bar + Delta
            states.append(S)
        states = torch.stack(states, 1)  # [P, T, dk, dv]
        ctx.save_for_backward(S0, K, V, w, gamma, states, L)
        return states

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_exact_fp32()  # autograd runs the backward outside the forward's context
    def backward(ctx, g_states):
        S0, K, V, w, gamma, states, L = ctx.saved_tensors
        T = K.shape[1]
        # eq. (app-adjoint), backwards in time: G_t = dL/dS_t collects the direct gradient and what S_{t+1} passes
        # back through S_bar_{t+1} = gamma_{t+1} S_t; A_t Lambda_t = G_t reuses the stored factor.
        lam, carry = [None] * T, 0
        for t in reversed(range(T)):
            lam[t] = _cholesky_solve(L[:, t], g_states[:, t] + carry)  # [P, dk, dv]  Lambda_t = dL/dS_bar_t
            carry = gamma[:, t, None, None] * lam[t]  # dL/dS_{t-1} = gamma_t Lambda_t
        lam = torch.stack(lam, 1)  # [P, T, dk, dv]
        prev = torch.cat([S0[:, None], states[:, :-1]], 1)  # [P, T, dk, dv]  S_{t-1}
        # eq. (app-grads), all frames at once
        KL = K @ lam  # [P, T, N, dv]  (K Lambda)_i: what token i retrieves from the update
        res = V - K @ states  # [P, T, N, dv]  (V - K S)_i: its residual at the solution
        g_V = w[..., None] * KL  # W K Lambda
        g_w = (KL * res).sum(-1)  # (K Lambda)_i (V - K S)_i^T
        g_K = w[..., None] * (res @ lam.mT - KL @ states.mT)  # W (V - K S) Lambda^T - W K Lambda S^T
        g_gamma = (lam * prev).sum((-2, -1))  # <Lambda_t, S_{t-1}>
        return carry, g_K, g_V, g_w, g_gamma


def joint_write_window(S, K, V, w, gamma, frame_valid=None):
    """T consecutive frame-synchronous joint writes, eq. (correction).
    S [..., dk, dv], K [..., T, N, dk] unit rows, V [..., T, N, dv], w [..., T, N] >= 0, gamma [..., T] in (0, 1],
    frame_valid [..., T] bool or None. Returns S_1..S_T [..., T, dk, dv] in fp32 (fp64 if an input is fp64).
    A padded frame (frame_valid False) leaves the state untouched, without decay; a valid frame whose weights are
    all zero returns gamma S (A = I). Appendix, masking."""
    T, N, dk = K.shape[-3:]
    dv = V.shape[-1]
    if S.shape[-2:] != (dk, dv) or V.shape[-3:-1] != (T, N) or w.shape[-2:] != (T, N) or gamma.shape[-1:] != (T,):
        shapes = ", ".join(f"{n} {tuple(x.shape)}" for n, x in zip("S K V w gamma".split(), (S, K, V, w, gamma)))
        raise ValueError(f"joint_write_window wants S [..., dk, dv], K [..., T, N, dk], V [..., T, N, dv], "
                         f"w [..., T, N], gamma [..., T]; got {shapes}")
    lead = torch.broadcast_shapes(S.shape[:-2], K.shape[:-3], V.shape[:-3], w.shape[:-2], gamma.shape[:-1])
    dt = torch.float64 if torch.float64 in (S.dtype, K.dtype, V.dtype, w.dtype, gamma.dtype) else torch.float32
    with _exact_fp32():
        if frame_valid is not None:  # padded frame: gamma = 1, w = 0  =>  A = I, Delta = 0, S_t = S_{t-1}
            gamma = torch.where(frame_valid, gamma, torch.ones_like(gamma))
            w = torch.where(frame_valid[..., None], w, torch.zeros_like(w))
        P = math.prod(lead)
        flat = lambda x, *shape: x.to(dt).expand(*lead, *shape).reshape(P, *shape)  # [*lead, *shape] -> [P, *shape]
        states = _JointWrite.apply(flat(S, dk, dv), flat(K, T, N, dk), flat(V, T, N, dv), flat(w, T, N), flat(gamma, T))
    return states.reshape(*lead, T, dk, dv)


def joint_write(S, K, V, w, gamma, frame_valid=None):
    """One frame-synchronous joint write, eqs. (joint-objective) -> (closed-form) -> (correction).
    S [..., dk, dv], K [..., N, dk] unit rows, V [..., N, dv], w [..., N] >= 0, gamma [...], frame_valid [...] bool.
    Returns S_bar + Delta, (I + K^T W K) Delta = K^T W (V - K S_bar), S_bar = gamma S; A^{-1} is never formed."""
    fv = None if frame_valid is None else frame_valid[..., None]
    out = joint_write_window(S, K[..., None, :, :], V[..., None, :, :], w[..., None, :], gamma[..., None], fv)
    return out[..., 0, :, :]  # [..., dk, dv]


def reset_state(state, rows):
    """S <- 0 in the batch rows [B] (bool) whose episode starts; a NaN or inf there is cleared too. state [B, ...]."""
    return torch.where(rows.bool().view(-1, *([1] * (state.dim() - 1))), 0.0, state)


# ---- The memory layer ------------------------------------------------------------------------------------------
@dataclass
class DRAMConfig:
    d_q: int = 256  # D_Q: query-source width (the fused output Y has the same width)
    d_k: int = 256  # D_K: key-source width
    d_v: int = 256  # D_V: value-source width
    n_heads: int = 4  # H
    head_dk: int = 64  # d_k per head
    head_dv: int = 64  # d_v per head
    kv_proj: bool = True  # False = "native KV": X^K, X^V already are H per-head keys / values (D_K = H dk, D_V = H dv)
    mixer: bool = False  # optional bidirectional intra-frame mixer (self-attention + MLP) on Y, Sec. 3.2
    mixer_heads: int = 4


class IntraFrameMixer(nn.Module):
    """Bidirectional self-attention + MLP over the M tokens of one frame (no mixing across time). Both residual
    branches end in zero-initialised projections, so a fresh mixer is the identity."""

    def __init__(self, d, n_heads):
        super().__init__()
        if d % n_heads:
            raise ValueError(f"DRAMConfig: width {d} is not divisible by mixer_heads = {n_heads}")
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        for p in (*self.proj.parameters(), *self.mlp[-1].parameters()):
            nn.init.zeros_(p)

    def forward(self, y, mask=None):  # y [..., M, D], mask [..., M] tokens that may be attended
        *lead, M, D = y.shape
        qkv = self.qkv(self.ln1(y)).view(*lead, M, 3, self.n_heads, -1)  # [..., M, 3, h, D/h]
        q, k, v = qkv.transpose(-4, -2).unbind(-3)  # 3 x [..., h, M, D/h]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[..., None, None, :])
        y = y + self.proj(a.transpose(-3, -2).reshape(*lead, M, D))  # [..., M, D]
        return y + self.mlp(self.ln2(y))


class DRAMLayer(nn.Module):
    """One memory layer: READ from S_{t-1}, FUSE into the query stream, then WRITE frame t (eqs. prim-read/fuse/write).
    x_q [B, T, M, D_Q], x_k [B, T, N, D_K], x_v [B, T, N, D_V]; q_mask [B, T, M], kv_mask [B, T, N] (p_i, True =
    real token); frame_valid [B, T]. The shared-source case passes one tensor three times (M = N)."""

    tap = None  # a dict: each call stores its gates, readout and states there (eval.py --trace); None: nothing kept

    def __init__(self, cfg: DRAMConfig):
        super().__init__()
        self.cfg = cfg
        H, dk, dv = cfg.n_heads, cfg.head_dk, cfg.head_dv
        if not cfg.kv_proj and (cfg.d_k != H * dk or cfg.d_v != H * dv):
            raise ValueError(f"DRAMConfig(kv_proj=False) needs d_k = n_heads head_dk, d_v = n_heads head_dv: {cfg}")
        # eq. (projections): a LayerNorm per source, the heads' projections in one matrix each
        self.ln_q, self.ln_k = nn.LayerNorm(cfg.d_q), nn.LayerNorm(cfg.d_k)  # ln_k: also the gates' input g_i
        self.ln_v = nn.LayerNorm(cfg.d_v) if cfg.kv_proj else None  # native KV: V is the host's own, as it is
        self.W_Q = nn.Linear(cfg.d_q, H * dk, bias=False)
        self.W_K = nn.Linear(cfg.d_k, H * dk, bias=False) if cfg.kv_proj else None
        self.W_V = nn.Linear(cfg.d_v, H * dv, bias=False) if cfg.kv_proj else None
        self.retention = nn.Linear(cfg.d_k, H)  # eq. (retention): (u_gamma, b_gamma) per head
        self.a_log = nn.Parameter(torch.zeros(H))  # a_h
        self.write_gate = nn.Linear(cfg.d_k, H)  # eq. (write-gate): (u_beta, b_beta) per head
        self.f_G = nn.Linear(cfg.d_q, H * dv)  # eq. (fuse): row-wise gate
        self.f_O = nn.Linear(H * dv, cfg.d_q)  # eq. (fuse): output projection, zero-initialised
        self.mixer = IntraFrameMixer(cfg.d_q, cfg.mixer_heads) if cfg.mixer else None
        self.reset_parameters()

    def reset_parameters(self):
        """gamma_h = exp(-dt_h), dt_h log-uniform over heads in [1e-3, 1e-1]: time constants of 10 to 1000 frames, a
        LIBERO episode's span. Write gates u_beta = b_beta = 0: beta = 0.5, w = 1. f_O = 0: a fresh layer returns X^Q."""
        c = self.cfg
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), c.n_heads))
        with torch.no_grad():
            self.retention.weight.zero_()
            self.retention.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^{-1}(dt)
            for p in (self.write_gate.weight, self.write_gate.bias, self.f_O.weight, self.f_O.bias):
                p.zero_()

    def init_state(self, batch_size, device=None):
        """S_0 = 0: [B, H, dk, dv], fp32 whatever the layer's dtype (appendix: the persistent state is fp32)."""
        c = self.cfg
        return torch.zeros(batch_size, c.n_heads, c.head_dk, c.head_dv, device=device, dtype=torch.float32)

    def project(self, x_q, x_k, x_v, kv_mask=None):
        """Everything that does not depend on the state, for any leading dims `*`: eqs. (projections), (retention),
        (write-gate). [*, M|N, D] -> Q [*, H, M, dk], K [*, H, N, dk], V [*, H, N, dv], w [*, H, N], gamma [*, H]."""
        c = self.cfg
        H, dk, dv = c.n_heads, c.head_dk, c.head_dv
        *lead, M, _ = x_q.shape
        N = x_k.shape[-2]
        z_q, z_k = self.ln_q(x_q), self.ln_k(x_k)  # Z = LN(X)
        gdt = torch.promote_types(z_k.dtype, torch.float32)  # keys and gates in >= fp32, also under bf16
        Q = F.normalize(self.W_Q(z_q).view(*lead, M, H, dk), dim=-1)  # [*, M, H, dk]
        k = self.W_K(z_k) if c.kv_proj else x_k  # native KV: the host's own per-head keys, only normalised
        v = self.W_V(self.ln_v(x_v)) if c.kv_proj else x_v
        K = F.normalize(k.to(gdt).view(*lead, N, H, dk), dim=-1)  # [*, N, H, dk]: the solve sees unit keys
        V = v.view(*lead, N, H, dv)  # [*, N, H, dv]
        # The gates run with fp32 weights, under autocast and in a bf16-cast layer too: a retention bias near -7
        # (dt ~ 1e-3) rounds to steps of 0.03 in bf16, a 1.5 % error in the decay rate that compounds over an episode.
        lin = lambda f, x: F.linear(x.to(gdt), f.weight.to(gdt), f.bias.to(gdt))
        m = torch.ones(z_k.shape[:-1], device=z_k.device) if kv_mask is None else kv_mask  # [*, N]
        m = m.to(gdt)[..., None]
        with torch.autocast(x_k.device.type, enabled=False):
            g_bar = (z_k.to(gdt) * m).sum(-2) / m.sum(-2).clamp(min=1.0)  # [*, D_K] mask-aware mean of the rows g_i
            gamma = torch.exp(-self.a_log.to(gdt).exp() * F.softplus(lin(self.retention, g_bar)))  # [*, H]
            beta = torch.sigmoid(lin(self.write_gate, z_k))  # [*, N, H]
        if self.tap is not None:
            self.tap.update(beta=beta, gamma=gamma)
        w = write_weights(beta, None if kv_mask is None else kv_mask[..., None])  # [*, N, H]
        return Q.transpose(-3, -2), K.transpose(-3, -2), V.transpose(-3, -2), w.transpose(-2, -1), gamma

    def fuse(self, x_q, R, q_mask=None):
        """eq. (fuse): Y = X^Q + f_O(sigmoid(f_G(X^Q)) * R). x_q [*, M, D_Q], R [*, M, H dv] -> Y [*, M, D_Q]."""
        gate = torch.sigmoid(self.f_G(x_q))  # [*, M, H dv]
        if self.tap is not None:
            self.tap["fuse_gate"] = gate
        delta = self.f_O(gate * R.to(x_q.dtype))
        if q_mask is not None:  # padded query rows get no readout
            delta = delta * q_mask[..., None].to(delta.dtype)
        y = x_q + delta
        return y if self.mixer is None else self.mixer(y, q_mask)

    def forward(self, x_q, x_k, x_v, state, q_mask=None, kv_mask=None, frame_valid=None):
        """A TBPTT window of T frames, in the paper's order per frame: read S_{t-1}, fuse, write.
        x_q [B, T, M, D_Q], x_k [B, T, N, D_K], x_v [B, T, N, D_V], state [B, H, dk, dv]. Returns
        (y [B, T, M, D_Q], readout R [B, T, M, H dv], final state [B, H, dk, dv]). Padded frames (frame_valid
        False, past an episode's end) pass through: R = 0, y = x_q, no write."""
        B, T, M, _ = x_q.shape
        Q, K, V, w, gamma = self.project(x_q, x_k, x_v, kv_mask)  # [B, T, H, M, dk], ..., gamma [B, T, H]
        fv = None if frame_valid is None else frame_valid[:, None, :].expand(B, gamma.shape[-1], T)  # [B, H, T]
        states = joint_write_window(state, K.transpose(1, 2), V.transpose(1, 2), w.transpose(1, 2),
                                    gamma.transpose(1, 2), fv)  # [B, H, T, dk, dv]  S_1..S_T
        prev = torch.cat([state[:, :, None], states[:, :, :-1]], 2)  # [B, H, T, dk, dv]  S_0..S_{T-1}
        R = read(Q.transpose(1, 2), prev)  # [B, H, T, M, dv]  eq. (read), pre-update states
        R = R.permute(0, 2, 3, 1, 4).reshape(B, T, M, -1)  # [B, T, M, H dv]  heads concatenated
        if self.tap is not None:
            self.tap.update(w=w, R=R, states=states)
        if frame_valid is None:
            return self.fuse(x_q, R, q_mask), R, states[:, :, -1]
        R = R * frame_valid[:, :, None, None].to(R.dtype)  # [B, T, M, H dv]
        return torch.where(frame_valid[:, :, None, None], self.fuse(x_q, R, q_mask), x_q), R, states[:, :, -1]

    def step(self, x_q, x_k, x_v, state, q_mask=None, kv_mask=None, frame_valid=None):
        """One frame (a control step): forward with T = 1. x_q [B, M, D_Q], ... -> (y [B, M, D_Q], R, new state)."""
        one = lambda x: None if x is None else x[:, None]  # [B, ...] -> [B, 1, ...]
        y, R, state = self.forward(one(x_q), one(x_k), one(x_v), state, one(q_mask), one(kv_mask), one(frame_valid))
        return y[:, 0], R[:, 0], state


class DRAMStack(nn.Module):
    """Shared-source memory (the DiT host, appendix): L layers stacked like a transformer, layer l+1 reads layer l's
    fused output Y; one state per layer. x [B, (T,) N, D] -> Y of the same shape, token number and order kept."""

    def __init__(self, cfg: DRAMConfig, depth: int = 2):
        super().__init__()
        if not (cfg.d_q == cfg.d_k == cfg.d_v):
            raise ValueError(f"DRAMStack is shared-source: it needs d_q == d_k == d_v, got {cfg}")
        self.cfg = cfg
        self.layers = nn.ModuleList([DRAMLayer(cfg) for _ in range(depth)])

    reset_state = staticmethod(reset_state)

    def init_state(self, batch_size, device=None):
        """[B, L, H, dk, dv] fp32 zeros."""
        return torch.stack([layer.init_state(batch_size, device) for layer in self.layers], 1)

    def forward(self, x, state, mask=None, frame_valid=None):
        """x [B, T, N, D], state [B, L, H, dk, dv] -> (y [B, T, N, D], final state [B, L, H, dk, dv])."""
        new = []
        for layer, s in zip(self.layers, state.unbind(1)):
            x, _, s = layer(x, x, x, s, mask, mask, frame_valid)  # X^Q = X^K = X^V: layer l's fused output
            new.append(s)
        return x, torch.stack(new, 1)

    def step(self, x, state, mask=None, frame_valid=None):
        """One frame: x [B, N, D], state [B, L, H, dk, dv] -> (y [B, N, D], new state)."""
        one = lambda z: None if z is None else z[:, None]  # [B, ...] -> [B, 1, ...]
        y, state = self.forward(x[:, None], state, one(mask), one(frame_valid))
        return y[:, 0], state

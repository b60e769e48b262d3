"""
Host policies: the two ways to plug DRAM into a frozen, pretrained policy (paper Sec. 3.2 "From readout to action",
Sec. 3.4, appendix "Flexible Integration Patterns"). READ / FUSE / WRITE are dram.py's, identical in both; only the
wiring differs.

  shared source (--host dit, GR00T-style DiT host)            separate source (--host vla, pi0.5-style host)

  cams --frozen ViT--> patch tokens (+cam emb, +instr)          [instr | cams' patches] --frozen ViT blocks 1..L-->
        |                                                              | layer l: native k_l, v_l, hidden h_l
        X_t = X^Q = X^K = X^V   (M = N)                         learned query slots --> DRAM layer 1 .. L (write
        |                                                              sources from backbone layer l; only the
   DRAMStack: read S_{t-1} -> fuse -> write, x depth                   query stream evolves) --> fused slots y_l
        |                                                              |  project to prefix k, v (position -1,
        Y_t (same tokens, same order)                                  |  not rotated, zero-gated)
        |                                                              v
   DiT action head: cross-attn to Y_t  <-> self-attn over         action expert layer l attends to
   [state, noisy actions], adaLN(time, instr)                     [backbone k_l, v_l | own tokens] + memory prefix

Interface used by train.py / eval.py (both hosts):
  encode(images, instr)            frozen parts only, a pure function of the observation -> cacheable features
  context(feats, instr, state, frame_valid)   advance the memory over a window [B, T, ...] -> (ctx, new_state)
  step(feats, instr, state)        one control step (one read-write transition) -> (ctx, new_state)
  loss(feats, instr, state, state_vec, actions, action_mask, frame_valid) -> (sum of per-frame losses, n_frames, state)
  sample(ctx, state_vec, instr, noise=None, steps=None) -> action chunk [B, C, Da]
  init_state(B, device), reset_state(state, rows)

Flow-matching convention (paper eq. fm, pi0's data-to-noise direction), stated once here:
  tau = 0 is DATA, tau = 1 is NOISE:  a_tau = (1 - tau) a + tau eps,  target velocity u = d a_tau / d tau = eps - a,
  tau = 0.999 b + 0.001, b ~ Beta(1.5, 1). Sampling integrates from tau = 1 (pure noise) down to tau = 0 with Euler
  steps a <- a - (1/n) v(a, tau).
"""
import hashlib
import math
from dataclasses import dataclass

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import dram
from dram import DRAMConfig, DRAMLayer, DRAMStack


@dataclass
class HostConfig:
    host: str = "dit"  # dit | vla
    memory: str = "dram"  # dram | none (the matched memoryless baseline)
    vision: str = "vit_tiny_patch16_224"  # timm model name of the frozen tower
    pretrained: bool = False  # True: timm hub weights (or weights_file)
    weights_file: str = ""  # local weights for the tower (offline), via pretrained_cfg_overlay=dict(file=...)
    image_size: int = 64  # square input size of the tower; must be a multiple of its patch size
    cameras: tuple = ("agentview_rgb", "eye_in_hand_rgb")
    state_dim: int = 8
    action_dim: int = 7
    chunk: int = 8  # C, action chunk length
    vocab: tuple = ()  # instruction strings seen in training (saved with the checkpoint)
    flow_steps: int = 10  # Euler steps at sampling
    # memory
    mem_depth: int = 2  # DRAMStack depth (dit) / memory layers for last_hidden (vla)
    mem_heads: int = 4
    mem_dk: int = 32
    mem_dv: int = 32
    mixer: bool = False  # intra-frame mixer after each fuse (dit)
    # DiT action head
    d_model: int = 128
    head_blocks: int = 4  # alternating cross-attention (even) / self-attention (odd) blocks
    head_heads: int = 4
    # pi0.5-style host
    write_source: str = "hidden"  # native_kv | hidden | last_hidden
    vla_layers: int = 4  # backbone depth used (first blocks of the ViT); the action expert has the same depth
    query_slots: int = 8  # M learned query slots

    def __post_init__(self):
        for k, ok in (("host", ("dit", "vla")), ("memory", ("dram", "none")),
                      ("write_source", ("native_kv", "hidden", "last_hidden"))):
            if getattr(self, k) not in ok:
                raise ValueError(f"--{k.replace('_', '-')} must be one of {', '.join(ok)}; got {getattr(self, k)!r}")
        if self.host == "dit" and self.d_model % self.head_heads:  # the DiT head splits d_model into head_heads
            raise ValueError(f"HostConfig.d_model = {self.d_model} (train.py --d-model) must be a multiple of "
                             f"head_heads = {self.head_heads}")


# --------------------------------------------------------------------------------------------------------------
# Frozen vision tower (shared by both hosts)
# --------------------------------------------------------------------------------------------------------------


class FrozenTower(nn.Module):
    """timm tower, frozen: eval mode, requires_grad False, no_grad, the model's own normalisation.

    With pretrained=False the random weights come from a fixed seed, so every process (training, cache,
    evaluation) builds the bit-identical tower; `fingerprint()` keys the feature cache and is checked at load."""

    def __init__(self, cfg: HostConfig):
        super().__init__()
        kw = dict(pretrained=cfg.pretrained, num_classes=0)
        if cfg.weights_file:  # custom_load off: timm 1.0.24 and older read any file of an .npz model (vit_tiny) as .npz
            kw.update(pretrained=True, pretrained_cfg_overlay=dict(file=cfg.weights_file, custom_load=False))
        if ":" not in cfg.vision and not timm.is_model(cfg.vision):  # (hf-hub: / local-dir: names are timm's too)
            raise ValueError(f"--vision {cfg.vision}: not a timm model name (timm.list_models('vit_*') lists some)")
        probe = timm.create_model(cfg.vision, pretrained=False, num_classes=0)
        self.is_vit = hasattr(probe, "patch_embed")
        if self.is_vit:
            patch = probe.patch_embed.patch_size[0]
            if cfg.image_size % patch:
                ok = [s for s in range(patch, 4 * cfg.image_size, patch)]
                near = min(ok, key=lambda s: abs(s - cfg.image_size))
                raise ValueError(f"--image-size {cfg.image_size} is not a multiple of {cfg.vision}'s patch size {patch}; use e.g. {near}")
            kw["img_size"] = cfg.image_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            try:
                self.model = timm.create_model(cfg.vision, **kw)
            except Exception as e:
                if cfg.weights_file:
                    raise ValueError(f"--weights-file {cfg.weights_file}: cannot load it into {cfg.vision} "
                                     f"({type(e).__name__}: {e})") from e
                if not (kw["pretrained"] and isinstance(e, OSError)):  # OSError: hub download / connection errors
                    raise
                raise RuntimeError(f"{cfg.vision}: the pretrained weights could not be fetched from the timm hub "
                                   f"({type(e).__name__}: {e}); offline, download them elsewhere and pass "
                                   f"--weights-file, or train without them (--no-pretrained)") from e
        if cfg.weights_file:
            # timm loads a file non-strictly once the classifier is dropped (num_classes=0): a file of another model
            # would leave the tower at its random initialisation without an error, so compare against that
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                init = timm.create_model(cfg.vision, **{**kw, "pretrained": False}).state_dict()
            loaded = self.model.state_dict()
            drawn = [n for n, v in init.items() if v.is_floating_point() and v.numel() > 1 and v.std() > 0]  # random
            kept = [n for n in drawn if torch.equal(init[n], loaded[n])]
            if len(kept) > len(drawn) // 2:
                raise ValueError(f"--weights-file {cfg.weights_file}: {len(kept)} of the {len(drawn)} randomly "
                                 f"initialised tensors of {cfg.vision} were not in it (e.g. {kept[:3]}); is it that "
                                 f"model's weights?")
        dc = timm.data.resolve_model_data_config(self.model)
        self.register_buffer("mean", torch.tensor(dc["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(dc["std"]).view(1, 3, 1, 1), persistent=False)
        self.size = cfg.image_size
        self.width = self.model.num_features
        self.model.eval().requires_grad_(False)

    def train(self, mode=True):  # stays in eval mode whatever the parent does
        return super().train(False)

    def preprocess(self, img):
        """uint8 [B, H, W, 3] upright -> normalised float [B, 3, s, s] (resized exactly as at evaluation)."""
        x = img.permute(0, 3, 1, 2).float() / 255.0  # [B, 3, H, W]
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def patch_tokens(self, x):
        """[B, 3, s, s] -> [B, P, D] patch tokens (prefix tokens dropped; CNN maps flattened)."""
        f = self.model.forward_features(x)
        if f.dim() == 4:  # CNN: [B, C, h, w] -> [B, h w, C]
            return f.flatten(2).transpose(1, 2)
        return f[:, getattr(self.model, "num_prefix_tokens", 0) :]

    def fingerprint(self):
        h = hashlib.sha1()
        for p in list(self.model.parameters())[:4] + list(self.model.parameters())[-2:]:
            h.update(p.detach().float().cpu().numpy().tobytes()[:4096])
        return h.hexdigest()[:12]


def sincos_2d(P, D):
    """2-D sin-cos position code of a square grid of P tokens (row-major) -> [P, D], entries in [-1, 1]."""
    side = int(round(math.sqrt(P)))
    if side * side != P or D % 4:
        return 0.02 * torch.randn(P, D)  # non-square token layout: plain learned embedding
    y, x = torch.meshgrid(torch.arange(side, dtype=torch.float32), torch.arange(side, dtype=torch.float32), indexing="ij")
    freqs = 1.0 / (100.0 ** (torch.arange(D // 4, dtype=torch.float32) / (D // 4)))  # [D/4]
    ang_y, ang_x = y.reshape(-1, 1) * freqs, x.reshape(-1, 1) * freqs  # [P, D/4] each
    return torch.cat([ang_y.sin(), ang_y.cos(), ang_x.sin(), ang_x.cos()], 1)  # [P, D]


def stack_cameras(images, cameras, device):
    """dict cam -> uint8 [B, H, W, 3] -> uint8 tensor [B * n_cam, H, W, 3] (camera-major within each frame)."""
    missing = [c for c in cameras if c not in images]
    if missing:
        raise KeyError(f"observation is missing camera(s) {missing}; have {sorted(images)}")
    x = torch.stack([torch.as_tensor(images[c]) for c in cameras], 1)  # [B, n_cam, H, W, 3]
    return x.flatten(0, 1).to(device)  # [B n_cam, H, W, 3]


# --------------------------------------------------------------------------------------------------------------
# Shared pieces of the action heads
# --------------------------------------------------------------------------------------------------------------


def sample_tau(n, device, inverse_cdf=None):
    """tau = 0.999 b + 0.001, b ~ Beta(1.5, 1) (eq. fm): favours the noisy end tau -> 1.

    Two samplers of the same law. On a GPU (inverse_cdf=None picks it off the CPU) b = U^(2/3), U ~ U(0, 1), the
    inverse of Beta(1.5, 1)'s CDF F(b) = b^1.5, drawn on the device: a training step captured as a CUDA graph
    then draws new tau at every replay (a CPU draw copied over would be frozen into the graph). On the CPU
    torch.distributions' Beta sampler, whose random stream the README's CPU runs were trained with."""
    if inverse_cdf is None:
        inverse_cdf = torch.device(device).type != "cpu"
    if inverse_cdf:
        b = torch.rand(n, device=device) ** (2.0 / 3.0)
    else:
        b = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0)).sample((n,)).to(device)
    return 0.999 * b + 0.001


def time_embedding(tau, dim):
    """Sinusoidal embedding of the flow time tau [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=tau.device) / half)
    ang = 1000.0 * tau[:, None] * freqs[None]  # [B, half]
    return torch.cat([ang.sin(), ang.cos()], -1)


class AdaLN(nn.Module):
    """adaLN: LN(x) * (1 + scale) + shift from the time embedding (zero-initialised modulation)."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.mod = nn.Linear(d, 2 * d)
        nn.init.zeros_(self.mod.weight)
        nn.init.zeros_(self.mod.bias)

    def forward(self, x, temb):  # x [B, n, d], temb [B, d]
        scale, shift = self.mod(F.silu(temb))[:, None].chunk(2, -1)  # [B, 1, d] each
        return self.ln(x) * (1 + scale) + shift


def mha(q, k, v, n_heads, mask=None):
    """q [B, n, d], k/v [B, m, d] -> [B, n, d]; plain multi-head attention (heads split from the width)."""
    B, n, d = q.shape
    split = lambda x: x.view(B, x.shape[1], n_heads, d // n_heads).transpose(1, 2)  # [B, h, *, d/h]
    o = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)  # [B, h, n, d/h]
    return o.transpose(1, 2).reshape(B, n, d)


class FlowHead(nn.Module):
    """Common flow-matching wrapper around a velocity network v(a_tau, tau; ctx, state, instr)."""

    def fm_loss(self, ctx, state_vec, instr, actions, action_mask):
        """eq. (fm) for F frames: actions [F, C, Da], action_mask [F, C] -> per-frame loss [F] (masked mean)."""
        Fr = actions.shape[0]
        tau = sample_tau(Fr, actions.device)  # [F]
        eps = torch.randn_like(actions)
        a_tau = (1 - tau[:, None, None]) * actions + tau[:, None, None] * eps
        u = eps - actions
        v = self.velocity(a_tau, tau, ctx, state_vec, instr)  # [F, C, Da]
        m = action_mask[..., None].to(v.dtype)  # [F, C, 1] padding past the episode end
        return ((v.float() - u) ** 2 * m).sum((1, 2)) / (m.sum((1, 2)) * actions.shape[-1]).clamp(min=1)

    @torch.no_grad()
    def sample(self, ctx, state_vec, instr, noise, steps):
        """Euler from tau = 1 (noise) to tau = 0 (data). noise [B, C, Da] -> actions [B, C, Da]."""
        a = noise
        for i in range(steps):
            tau = torch.full((a.shape[0],), 1.0 - i / steps, device=a.device)
            a = a - self.velocity(a, tau, ctx, state_vec, instr).float() / steps
        return a


# --------------------------------------------------------------------------------------------------------------
# Shared-source pattern: the DiT host
# --------------------------------------------------------------------------------------------------------------


class DiTBlock(nn.Module):
    """GR00T-style block: adaLN -> attention (cross to the frame tokens Y, or self over [state, actions]) -> LN -> MLP."""

    def __init__(self, d, d_ctx, n_heads, cross):
        super().__init__()
        self.cross, self.n_heads = cross, n_heads
        self.norm1 = AdaLN(d)
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d_ctx if cross else d, 2 * d)
        self.o = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, temb, y):  # x [B, 1 + C, d], y [B, n, d_ctx]
        h = self.norm1(x, temb)
        k, v = self.kv(y if self.cross else h).chunk(2, -1)
        x = x + self.o(mha(self.q(h), k, v, self.n_heads))
        return x + self.mlp(self.norm2(x))


class DiTHead(FlowHead):
    """DiT action head: tokens [state, a_tau^1..C] (learned positions on actions), adaLN on the flow time and the
    instruction, blocks alternating cross-attention to the conditioning tokens Y and self-attention.

    Why the instruction also enters the adaLN: in GR00T the conditioning tokens come from a vision-language model, so
    every token carries the instruction. Here the tower sees images only and the instruction is one token among
    n_cam P + 1, which the head has to find by cross-attention. Adding a learned instruction embedding to the time
    embedding (FiLM-style) lets every block depend on the task directly. On the embedded suite it raised the mean
    success of the default run by about 5 points over seven seeds, mostly through cue_location (README, Measured)."""

    def __init__(self, cfg: HostConfig, d_ctx):
        super().__init__()
        d = cfg.d_model
        self.state_in = nn.Linear(cfg.state_dim, d)
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.pos = nn.Parameter(0.02 * torch.randn(cfg.chunk, d))
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([DiTBlock(d, d_ctx, cfg.head_heads, cross=(i % 2 == 0)) for i in range(cfg.head_blocks)])
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.action_dim))
        self.instr_cond = nn.Embedding(max(len(cfg.vocab), 1), d)  # instruction -> adaLN conditioning
        self.d = d

    def velocity(self, a_tau, tau, ctx, state_vec, instr):
        temb = self.t_mlp(time_embedding(tau, self.d)) + self.instr_cond(instr)  # [B, d] flow time + instruction
        x = torch.cat([self.state_in(state_vec)[:, None], self.action_in(a_tau) + self.pos], 1)  # [B, 1 + C, d]
        for blk in self.blocks:
            x = blk(x, temb, ctx["tokens"])
        return self.out(x[:, 1:])  # [B, C, Da]


class Host(nn.Module):
    """What train.py and eval.py see. Subclasses define encode / context / head."""

    # True where encode + step + sample never wait for the host, so that eval.py may capture a control step as CUDA
    # graphs (checked on a GPU by test_cuda_graph_policy_acts_like_the_eager_policy)
    cuda_graphs = False

    def instr_ids(self, instructions, device=None):
        """Instruction strings -> ids into the vocabulary saved with the checkpoint; unknown ones are an error."""
        index = {s: i for i, s in enumerate(self.cfg.vocab)}
        unknown = [s for s in instructions if s not in index]
        if unknown:
            raise KeyError(f"instruction(s) unknown to this checkpoint: {unknown!r}; it was trained on {list(self.cfg.vocab)!r}")
        return torch.tensor([index[s] for s in instructions], device=device)

    def reset_state(self, state, rows):
        return dram.reset_state(state, rows)

    def step(self, feats, instr, state):
        """One control step: exactly one memory read-write transition. feats [B, ...] -> (ctx [B, ...], new_state)."""
        ctx, state = self.context(feats[:, None], instr, state)
        return {k: v[:, 0] for k, v in ctx.items()}, state

    def loss(self, feats, instr, state, state_vec, actions, action_mask, frame_valid, fixed_shapes=False):
        """Flow-matching loss of a TBPTT window. feats [B, T, ...], state_vec [B, T, Ds], actions [B, T, C, Da],
        action_mask [B, T, C], frame_valid [B, T]. Gradients run through the whole window (reads, gates, solve).
        Returns (sum over valid frames of the per-frame loss, number of valid frames [] long, new memory state).

        Only the valid frames reach the memory's projections and the head, selected by boolean indexing (shapes
        depend on frame_valid's values). fixed_shapes=True runs all B T frames and zeroes the padded frames'
        losses instead: the same loss (for the same tau and noise), no host round trip, ~20% more work."""
        ctx, new_state = self.context(feats, instr, state, frame_valid, fixed_shapes)  # ctx values [B, T, ...]
        B, T = frame_valid.shape
        sel = frame_valid.reshape(-1)  # [B T]
        flat = lambda x: x.reshape(B * T, *x.shape[2:])  # [B, T, ...] -> [B T, ...]
        pick = flat if fixed_shapes else lambda x: flat(x)[sel]  # default: only valid frames reach the head [F, ...]
        ctx_v = {k: pick(v) for k, v in ctx.items()}
        instr_v = pick(instr[:, None].expand(B, T))  # [F | B T]
        per_frame = self.head.fm_loss(ctx_v, pick(state_vec), instr_v, pick(actions), pick(action_mask))  # [F | B T]
        if fixed_shapes:
            per_frame = per_frame * sel.to(per_frame.dtype)
        return per_frame.sum(), sel.sum(), new_state

    def sample(self, ctx, state_vec, instr, noise=None, steps=None):
        """Action chunk [B, C, Da] (normalised units) for one frame's context; noise fixes the draw for tests."""
        B = state_vec.shape[0]
        if noise is None:
            noise = torch.randn(B, self.cfg.chunk, self.cfg.action_dim, device=state_vec.device)
        return self.head.sample(ctx, state_vec, instr, noise, steps or self.cfg.flow_steps)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


class DiTHost(Host):
    """Shared-source pattern (appendix, DiT host): frame tokens are query, key and value sources at once (M = N)."""

    cuda_graphs = True

    def __init__(self, cfg: HostConfig):
        super().__init__()
        self.cfg = cfg
        self.tower = FrozenTower(cfg)
        D = self.tower.width
        n_cam = len(cfg.cameras)
        self.cam_embed = nn.Parameter(0.02 * torch.randn(n_cam, 1, D))  # learned camera embedding
        # learned patch-position embedding, initialised with a 2-D sin-cos grid: attention is permutation
        # invariant, so the head only knows where a token is if the token says so. Pretrained towers encode it
        # strongly; a randomly initialised tower (offline tests, the embedded suite) barely does (~0.3% of the
        # token power), which makes localisation needlessly slow to learn.
        with torch.no_grad():
            P = self.tower.patch_tokens(torch.zeros(1, 3, cfg.image_size, cfg.image_size)).shape[1]
        self.patch_pos = nn.Parameter(sincos_2d(P, D))  # [P, D]
        self.instr_embed = nn.Embedding(max(len(cfg.vocab), 1), D)  # learned instruction token
        mcfg = DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=cfg.mem_heads, head_dk=cfg.mem_dk, head_dv=cfg.mem_dv, mixer=cfg.mixer)
        self.memory = DRAMStack(mcfg, cfg.mem_depth) if cfg.memory == "dram" else None
        self.head = DiTHead(cfg, D)

    def encode(self, images, instr=None):
        """Frozen tower on all cameras of a batch of frames in one call: dict cam -> uint8 [B, H, W, 3] upright
        -> patch tokens [B, n_cam P, D] (a pure function of the observation, hence cacheable)."""
        x = stack_cameras(images, self.cfg.cameras, self.tower.mean.device)  # [B n_cam, H, W, 3]
        tok = self.tower.patch_tokens(self.tower.preprocess(x))  # [B n_cam, P, D]
        n_cam = len(self.cfg.cameras)
        return tok.reshape(-1, n_cam * tok.shape[1], tok.shape[2])  # [B, n_cam P, D]

    def init_state(self, batch_size, device=None):
        if self.memory is None:
            return torch.zeros(batch_size, 0, device=device)
        return self.memory.init_state(batch_size, device)

    def context(self, feats, instr, state, frame_valid=None, fixed_shapes=False):
        """feats [B, T, n_cam P, D] -> ({"tokens": Y [B, T, n_cam P + 1, D]}, new_state)."""
        B, T, NP, D = feats.shape
        n_cam = len(self.cfg.cameras)
        x = feats.to(self.cam_embed.dtype).view(B, T, n_cam, NP // n_cam, D) + self.cam_embed + self.patch_pos
        # x: [B, T, n_cam, P, D]
        x = x.reshape(B, T, NP, D)
        lang = self.instr_embed(instr)[:, None, None].expand(B, T, 1, D)  # [B, T, 1, D]
        x = torch.cat([x, lang], 2)  # [B, T, N, D] the frame's token sequence X_t
        if self.memory is None:
            return {"tokens": x}, state
        y, state = self.memory(x, state, None, frame_valid, fixed_shapes)  # shared source: X^Q = X^K = X^V = X_t
        return {"tokens": y}, state


# --------------------------------------------------------------------------------------------------------------
# Separate-source pattern: the pi0.5-style host
# --------------------------------------------------------------------------------------------------------------


def rope(x, pos):
    """Rotary position embedding (half-split form). x [B, h, n, dh], pos [n] (float) -> rotated x."""
    dh = x.shape[-1]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dh // 2, device=x.device, dtype=torch.float32) / (dh // 2)))
    ang = pos.float()[:, None] * freqs[None]  # [n, dh/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def expert_attention(q, k, v, k_pre, v_pre, gate):
    """Action-expert attention with a memory prefix. q [B, h, n, dh] (rotated), k/v [B, h, m, dh] (backbone + own
    tokens, rotated keys), k_pre/v_pre [B, h, M, dh] (memory prefix: reserved position -1, keys NOT rotated) or None,
    gate [h] zero-initialised.

    The prefix gets its own softmax and is added through the gate (zero-gated attention as in LLaMA-Adapter): a
    zero-valued prefix in the joint softmax would still take probability mass from the host's keys, whereas this
    form is an exact no-op at initialisation and learns how much history to let in."""
    o = F.scaled_dot_product_attention(q, k, v)  # [B, h, n, dh]
    if k_pre is None:
        return o
    o_pre = F.scaled_dot_product_attention(q, k_pre, v_pre)  # [B, h, n, dh]
    return o + gate.view(1, -1, 1, 1).to(o.dtype) * o_pre


class ExpertLayer(nn.Module):
    """Action-expert layer l (pi0-style): its tokens attend to backbone layer l's native keys/values plus their own,
    plus the memory prefix of memory layer l."""

    def __init__(self, d, n_heads, memory):
        super().__init__()
        self.h = n_heads
        self.norm1 = AdaLN(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        if memory:
            self.pre_k, self.pre_v = nn.Linear(d, d), nn.Linear(d, d)  # readout -> prefix keys / values
            self.gate = nn.Parameter(torch.zeros(n_heads))  # zero-init: exact no-op at initialisation

    def forward(self, x, temb, kv_l, prefix):
        """x [B, n, d] own tokens, kv_l [B, 2, m, d] backbone layer-l native (pre-RoPE) keys/values,
        prefix [B, M, d] fused query-slot readout or None."""
        B, n, d = x.shape
        m = kv_l.shape[2]
        heads = lambda z: z.view(B, z.shape[1], self.h, d // self.h).transpose(1, 2)  # [B, h, *, d/h]
        q, k, v = (heads(z) for z in self.qkv(self.norm1(x, temb)).chunk(3, -1))
        pos_host = torch.arange(m, device=x.device)  # backbone tokens keep positions 0 .. m-1
        pos_own = torch.arange(m, m + n, device=x.device)  # the expert's tokens follow them
        kb, vb = heads(kv_l[:, 0].to(x.dtype)), heads(kv_l[:, 1].to(x.dtype))  # [B, h, m, d/h]
        k_all = torch.cat([rope(kb, pos_host), rope(k, pos_own)], 2)  # [B, h, m + n, d/h]
        v_all = torch.cat([vb, v], 2)
        k_pre = v_pre = None
        if prefix is not None:  # memory slots: reserved position -1 => their keys are not rotated
            k_pre, v_pre = heads(self.pre_k(prefix)), heads(self.pre_v(prefix))  # [B, h, M, d/h]
        o = expert_attention(rope(q, pos_own), k_all, v_all, k_pre, v_pre, getattr(self, "gate", None))
        x = x + self.o(o.transpose(1, 2).reshape(B, n, d))
        return x + self.mlp(self.norm2(x))


class ExpertHead(FlowHead):
    """pi0-style action expert of the backbone's depth: own tokens [state + instruction, a_tau^1..C]."""

    def __init__(self, cfg: HostConfig, d, n_heads, memory):
        super().__init__()
        self.state_in = nn.Linear(cfg.state_dim, d)
        self.instr_embed = nn.Embedding(max(len(cfg.vocab), 1), d)  # learned instruction embedding
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.layers = nn.ModuleList([ExpertLayer(d, n_heads, memory) for _ in range(cfg.vla_layers)])
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.action_dim))
        self.d = d

    def velocity(self, a_tau, tau, ctx, state_vec, instr):
        temb = self.t_mlp(time_embedding(tau, self.d))  # [B, d]
        s = self.state_in(state_vec) + self.instr_embed(instr)  # [B, d]
        x = torch.cat([s[:, None], self.action_in(a_tau)], 1)  # [B, 1 + C, d]
        pre = ctx.get("prefix")  # [B, L_mem, M, d] or None
        for l, layer in enumerate(self.layers):
            p = None if pre is None else pre[:, min(l, pre.shape[1] - 1)]  # last_hidden: one readout for all layers
            x = layer(x, temb, ctx["kv"][:, l], p)
        return self.out(x[:, 1:])


class VLAHost(Host):
    """Separate-source pattern (appendix, pi0.5 host) at a size that runs: a frozen ViT as the "VLM" backbone
    ([instruction token | patch tokens of all cameras] through its first `vla_layers` blocks), memory layers aligned
    with backbone layers, learned query slots, and readouts injected as prefix keys/values of the action expert.
    Not captured as CUDA graphs (cuda_graphs False): not yet checked on a GPU."""

    def __init__(self, cfg: HostConfig):
        super().__init__()
        self.cfg = cfg
        self.tower = FrozenTower(cfg)
        vit = self.tower.model
        if not self.tower.is_vit or not hasattr(vit, "blocks"):
            raise ValueError(f"--host vla needs a ViT backbone with .blocks, {cfg.vision} has none")
        if cfg.vla_layers > len(vit.blocks):
            raise ValueError(f"--vla-layers {cfg.vla_layers} > {len(vit.blocks)} blocks of {cfg.vision}")
        D, nh = vit.embed_dim, vit.blocks[0].attn.num_heads
        self.D, self.nh = D, nh
        mem = cfg.memory == "dram"
        if mem:
            self.slots = nn.Parameter(0.02 * torch.randn(cfg.query_slots, D))  # M learned query slots
            if cfg.write_source == "native_kv":  # the backbone's own per-head keys/values, no DRAM projection
                mc = DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=nh, head_dk=D // nh, head_dv=D // nh, kv_proj=False)
            else:
                mc = DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=cfg.mem_heads, head_dk=cfg.mem_dk, head_dv=cfg.mem_dv)
            n_mem = cfg.mem_depth if cfg.write_source == "last_hidden" else cfg.vla_layers
            self.memory = nn.ModuleList([DRAMLayer(mc) for _ in range(n_mem)])
        else:
            self.memory = None
        self.head = ExpertHead(cfg, D, nh, mem)
        # frozen 'language model' embedding: a fixed pseudo-random vector per instruction string (seeded by its hash,
        # not by the vocabulary's order), so the frozen features stay a pure function of (observation, instruction)
        seeds = [int(hashlib.sha1(s.encode()).hexdigest()[:12], 16) for s in cfg.vocab]
        table = [torch.randn(D, generator=torch.Generator().manual_seed(sd)) for sd in seeds]
        self.register_buffer("text_table", torch.stack(table) if table else torch.zeros(0, D), persistent=False)

    def text_token(self, instr):
        """instruction ids [B] -> their frozen text tokens [B, D] (a lookup on the device: no host round trip)."""
        return self.text_table[instr.to(self.text_table.device)]

    @torch.no_grad()
    def encode(self, images, instr):
        """-> per-layer features [B, L * 3 * n, D] (viewed as [B, L, 3, n, D]): native key, native value (the qkv projection's outputs, pre-RoPE)
        and the hidden output of each backbone layer; n = 1 + n_cam P ([instruction | patches])."""
        vit = self.tower.model
        x = stack_cameras(images, self.cfg.cameras, self.tower.mean.device)  # [B n_cam, H, W, 3]
        p = vit._pos_embed(vit.patch_embed(self.tower.preprocess(x)))[:, vit.num_prefix_tokens :]  # [B n_cam, P, D]
        B = p.shape[0] // len(self.cfg.cameras)
        h = torch.cat([self.text_token(instr)[:, None].to(p.dtype), p.reshape(B, -1, self.D)], 1)  # [B, n, D]
        h = vit.norm_pre(h)  # as timm's forward_features before the blocks (a LayerNorm in CLIP-style towers)
        feats = []
        for blk in vit.blocks[: self.cfg.vla_layers]:
            qkv = []
            hook = blk.attn.qkv.register_forward_hook(lambda m, i, o: qkv.append(o))
            h = blk(h)
            hook.remove()
            _, k, v = qkv[0].chunk(3, -1)  # [B, n, D] each, all heads concatenated (timm's qkv layout)
            feats.append(torch.stack([k, v, h], 1))  # [B, 3, n, D]
        return torch.stack(feats, 1).flatten(1, 3)  # [B, L 3 n, D]: flat like the DiT tokens, for the cache

    def init_state(self, batch_size, device=None):
        if self.memory is None:
            return torch.zeros(batch_size, 0, device=device)
        return torch.stack([m.init_state(batch_size, device) for m in self.memory], 1)  # [B, L_mem, H, dk, dv]

    def context(self, feats, instr, state, frame_valid=None, fixed_shapes=False):
        """feats [B, T, L 3 n, D] -> ({"kv": [B, T, L, 2, n, D], "prefix": [B, T, L_mem, M, D]}, new_state).
        Only the query slots evolve across memory layers; the host's own tokens are untouched."""
        B, T, LN, D = feats.shape
        L = self.cfg.vla_layers
        feats = feats.view(B, T, L, 3, LN // (3 * L), D)  # [B, T, L, 3, n, D]: (native k, native v, hidden)
        ctx = {"kv": feats[:, :, :, :2]}
        if self.memory is None:
            return ctx, state
        q = self.slots.expand(B, T, *self.slots.shape)  # [B, T, M, D]
        outs, new = [], []
        for l, layer in enumerate(self.memory):
            src = feats[:, :, -1, 2] if self.cfg.write_source == "last_hidden" else feats[:, :, l]  # [B, T, (3,) n, D]
            if self.cfg.write_source == "native_kv":
                xk, xv = src[:, :, 0], src[:, :, 1]  # backbone layer-l keys / values [B, T, n, D]
            elif self.cfg.write_source == "hidden":
                xk = xv = src[:, :, 2]  # backbone layer-l hidden tokens
            else:
                xk = xv = src  # final-layer hidden tokens, shared by every memory layer
            q, _, s = layer(q, xk.float(), xv.float(), state[:, l], None, None, frame_valid, fixed_shapes)  # [B, T, M, D]
            outs.append(q)
            new.append(s)
        prefix = torch.stack(outs[-1:] if self.cfg.write_source == "last_hidden" else outs, 2)  # [B, T, L_mem, M, D]
        ctx["prefix"] = prefix
        return ctx, torch.stack(new, 1)


def capture_cuda_graph(fn, warmup=3, after_warmup=None, device=None):
    """Record fn() as a CUDA graph. Returns (graph, out): graph.replay() reruns all of fn's kernels with one launch,
    on the same input buffers (the tensors fn reads) and into the same output buffers (out). fn must not
    synchronise with the host (no .item(), no shapes that depend on data). Warm-up runs (cuBLAS workspaces, lazy
    initialisation) go on a side stream first, as torch.cuda.graph requires; they execute fn. after_warmup() runs
    between them and the capture. device: the GPU that fn's tensors live on (None: the current one); streams are
    per device, and kernels launched on another device's stream would not be captured. The graph keeps fn (and so
    every tensor fn refers to: weights, optimizer state, static inputs) alive: a replay reads and writes their
    memory by address, and memory freed after the capture would be reused by other tensors or handed back to the
    driver (torch.cuda.graph empties the cache on entry), a silent corruption or an illegal access. Used by eval.py
    (control step), train.py (training step) and bench.py."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        if after_warmup is not None:
            after_warmup()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    graph.fn = fn
    return graph, out


def make_host(name, config: HostConfig):
    """Factory used by train.py / eval.py."""
    config.host = name
    config.__post_init__()  # the host's name and the settings changed since construction are checked again
    return DiTHost(config) if name == "dit" else VLAHost(config)

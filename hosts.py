"""
Host policies: the two ways to plug DRAM into a frozen, pretrained policy (paper Sec. 3.2 "From readout to action",
Sec. 3.4, appendix "Flexible Integration Patterns"). READ / FUSE / WRITE are dram.py's, identical in both; only the
wiring differs: shared source (--host dit, GR00T-style) writes and reads the frame tokens the DiT head attends to;
separate source (--host vla, pi0.5-style) writes backbone features and reads into a query stream of its own (a copy of
the current frame's last hidden tokens, or learned query slots) that the action expert attends to as prefix keys /
values.

train.py and eval.py see class Host. A checkpoint describes a host: save / read / load_checkpoint live here.

Flow-matching convention (paper eq. fm, pi0's data-to-noise direction):
  tau = 0 is DATA, tau = 1 is NOISE:  a_tau = (1 - tau) a + tau eps,  target velocity u = d a_tau / d tau = eps - a,
  tau = 0.999 b + 0.001, b ~ Beta(1.5, 1). Sampling integrates from tau = 1 (pure noise) down to tau = 0 with Euler
  steps a <- a - (1/n) v(a, tau).
"""
import contextlib
import hashlib
import io
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import huggingface_hub
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import dram
from dram import DRAMConfig, DRAMLayer, DRAMStack


class ConfigError(ValueError):
    """A setting or file the user chose cannot work; the message names the flag or file that fixes it (one line)."""


@dataclass
class HostConfig:
    """A host's architecture. The defaults are train.py's on the embedded suite, the single source of both:
    make_host(name, HostConfig(vocab=..., action_dim=...)) builds the host `name` that train.py trains there, except
    that train.py gives the dit host one memory layer (train.DIT_MEMORY_DEPTH) and the vla host 8 memory heads of 16
    (train.VLA_MEMORY)."""
    host: str = "dit"  # dit | vla
    memory: str = "dram"  # dram | none (the matched memoryless baseline)
    vision: str = "vit_tiny_patch16_224"  # timm model name of the frozen tower
    pretrained: bool = False  # True: timm hub weights (or weights_file)
    weights_file: str = ""  # local weights for the tower (offline), via pretrained_cfg_overlay=dict(file=...)
    image_size: int = 64  # square input size of the tower; must be a multiple of its patch size
    cameras: tuple = ("agentview_rgb", "eye_in_hand_rgb")
    state_dim: int = 8
    action_dim: int = 7
    chunk: int = 4  # C, action chunk length
    vocab: tuple = ()  # instruction strings seen in training (saved with the checkpoint)
    flow_steps: int = 10  # Euler steps at sampling
    mem_depth: int = 2  # DRAMStack depth (dit) / memory layers for last_hidden (vla)
    mem_heads: int = 4
    mem_dk: int = 32
    mem_dv: int = 32
    mixer: bool = False  # intra-frame mixer after each fuse (dit)
    d_model: int = 128  # DiT action head width
    head_blocks: int = 4  # alternating cross-attention (even) / self-attention (odd) blocks
    head_heads: int = 4
    write_source: str = "last_hidden"  # pi0.5-style (vla) host: native_kv | hidden | last_hidden
    vla_layers: int = 4  # backbone depth used (first blocks of the ViT); the action expert has the same depth
    query: str = "frame"  # vla: the memory's query stream, frame (a copy of the frame's h_L tokens) | slots (learned)
    query_slots: int = 8  # M learned query slots (query = slots)
    pos_code: bool = True  # fixed 2-D position + camera code on the patch tokens before the frozen blocks
    key_norm: bool = True  # per-head RMS normalisation of the keys the action expert attends to
    kv_adapter: bool = True  # a learned linear map per expert layer on the backbone keys / values it reads (init I)
    write_centre: bool = True  # the memory's write sources centred over each frame's tokens

    def __post_init__(self):
        for k, ok in (("host", ("dit", "vla")), ("memory", ("dram", "none")), ("query", ("frame", "slots")),
                      ("write_source", ("native_kv", "hidden", "last_hidden"))):
            if getattr(self, k) not in ok:
                raise ConfigError(f"--{k.replace('_', '-')} must be one of {', '.join(ok)}; got {getattr(self, k)!r}")
        if self.host == "dit" and self.d_model % self.head_heads:  # the DiT head splits d_model into head_heads
            raise ConfigError(f"HostConfig.d_model = {self.d_model} (train.py --d-model) must be a multiple of "
                              f"head_heads = {self.head_heads}")


# ---- Frozen vision tower (shared by both hosts) ------------------------------------------------------------------
def hub_reachable(timeout=3.0):
    """One request to the model hub, answered within `timeout` seconds or taken as offline."""
    try:
        huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=timeout)
        return True
    except Exception:
        return False


class FrozenTower(nn.Module):
    """timm tower, frozen (eval mode, no grad, its own normalisation). Its random weights come from a fixed seed: every
    process builds the bit-identical tower; `fingerprint()` keys the feature cache and is checked at load."""

    def __init__(self, cfg: HostConfig):
        super().__init__()
        if ":" not in cfg.vision and not timm.is_model(cfg.vision):  # (hf-hub: / local-dir: names are timm's too)
            raise ConfigError(f"--vision {cfg.vision}: not a timm model name (timm.list_models('vit_*') lists some)")
        probe = timm.create_model(cfg.vision, pretrained=False, num_classes=0)
        self.is_vit = hasattr(probe, "patch_embed")
        patch = probe.patch_embed.patch_size[0] if self.is_vit else 1
        if cfg.image_size % patch:
            raise ConfigError(f"--image-size {cfg.image_size} is not a multiple of {cfg.vision}'s patch size {patch}; "
                              f"use e.g. {max(patch, round(cfg.image_size / patch) * patch)}")
        size = dict(img_size=cfg.image_size) if self.is_vit else {}

        def create(pretrained, **kw):  # seeded in a forked generator: the caller's random stream is left as it was
            with torch.random.fork_rng(devices=[]):  # (the CPU's, which timm draws from; not a GPU's: not reseeded)
                torch.random.default_generator.manual_seed(0)
                return timm.create_model(cfg.vision, pretrained=pretrained, num_classes=0, **size, **kw)

        self.model = create(False)
        if cfg.weights_file:
            random_init = self.fingerprint()
            try:  # custom_load off: timm reads any file of an .npz model (vit_tiny) as .npz
                self.model = create(True, pretrained_cfg_overlay=dict(file=cfg.weights_file, custom_load=False))
            except Exception as e:
                raise ConfigError(f"--weights-file {cfg.weights_file}: cannot load it into {cfg.vision} "
                                  f"({type(e).__name__}: {e})") from e
            # timm loads non-strictly without the classifier: another model's file would silently keep the random init
            if self.fingerprint() == random_init:
                raise ConfigError(f"--weights-file {cfg.weights_file}: {cfg.vision}'s weights are not in it (the tower "
                                  f"kept its random initialisation); is it that model's file?")
        elif cfg.pretrained:
            # offline, huggingface_hub retries each file for about 50 s: then read the local cache only
            offline = not cfg.vision.startswith("local-dir:") and not hub_reachable()
            cache_only = mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
            try:
                with cache_only if offline else contextlib.nullcontext():
                    self.model = create(True)
            except OSError as e:  # hub download / connection errors
                why = "the hub is unreachable, the local cache lacks them" if offline else " ".join(str(e).split())
                raise ConfigError(f"{cfg.vision}: no pretrained weights ({why}); pass --weights-file PATH (the "
                                  f"weights downloaded elsewhere) or train without them: --no-pretrained") from e
        dc = timm.data.resolve_model_data_config(self.model)
        self.register_buffer("mean", torch.tensor(dc["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(dc["std"]).view(1, 3, 1, 1), persistent=False)
        self.size, self.width = cfg.image_size, self.model.num_features
        self.model.eval().requires_grad_(False)
        self.n_patches = self.patch_tokens(torch.zeros(1, 3, cfg.image_size, cfg.image_size)).shape[1]  # P

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
    """2-D sin-cos position code of the square grid of P tokens (row-major) of a square image -> [P, D] (4 | D)."""
    grid = torch.arange(math.isqrt(P), dtype=torch.float32)
    y, x = torch.meshgrid(grid, grid, indexing="ij")
    freqs = 1.0 / (100.0 ** (torch.arange(D // 4, dtype=torch.float32) / (D // 4)))  # [D/4]
    ang_y, ang_x = y.reshape(-1, 1) * freqs, x.reshape(-1, 1) * freqs  # [P, D/4] each
    return torch.cat([ang_y.sin(), ang_y.cos(), ang_x.sin(), ang_x.cos()], 1)  # [P, D]


def stack_cameras(images, cameras, device):
    """dict cam -> uint8 [B, H, W, 3] -> uint8 tensor [B * n_cam, H, W, 3] (camera-major within each frame)."""
    x = torch.stack([torch.as_tensor(images[c]) for c in cameras], 1)  # [B, n_cam, H, W, 3]
    return x.flatten(0, 1).to(device)  # [B n_cam, H, W, 3]


# ---- Shared by both hosts: flow matching, the Host interface -----------------------------------------------------
def sample_tau(n, device):
    """tau = 0.999 b + 0.001, b ~ Beta(1.5, 1) (eq. fm), which favours the noisy end tau -> 1. [n] on `device`.
    Inverse CDF: F(b) = b^1.5, so b = U^(2/3) with U ~ U(0, 1)."""
    b = torch.rand(n, device=device) ** (2.0 / 3.0)
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


class FlowHead(nn.Module):
    """Flow matching (eq. fm) around a velocity network v(a_tau, tau; ctx, state, instr)."""

    def fm_loss(self, ctx, state_vec, instr, actions, action_mask):
        """F frames: actions [F, C, Da], action_mask [F, C] -> per-frame loss [F] (mean over the valid actions)."""
        tau, eps = sample_tau(actions.shape[0], actions.device), torch.randn_like(actions)  # [F], [F, C, Da]
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


class Host(nn.Module):
    """What train.py and eval.py see. DiTHost and VLAHost build the memory and head and define encode / context."""

    cuda_graphs = False  # eval.py may capture the control step as a CUDA graph (checked on a GPU for the DiT host)
    reset_state = staticmethod(dram.reset_state)

    def __init__(self, cfg: HostConfig):
        super().__init__()
        self.cfg, self.tower = cfg, FrozenTower(cfg)

    def init_state(self, batch_size, device=None):
        """S_0 = 0 of every memory layer, fp32 [B, L_mem, H, dk, dv] ([B, 0] without memory)."""
        if self.memory is None:
            return torch.zeros(batch_size, 0, device=device)
        layers = getattr(self.memory, "layers", self.memory)  # a DRAMStack's layers, or the vla host's list
        return torch.stack([m.init_state(batch_size, device) for m in layers], 1)

    def instr_ids(self, instructions, device=None):
        """Instruction strings -> ids into the vocabulary saved with the checkpoint; unknown ones are an error."""
        index = {s: i for i, s in enumerate(self.cfg.vocab)}
        if unknown := [s for s in instructions if s not in index]:
            raise KeyError(f"instruction(s) unknown to this checkpoint: {unknown!r}; it was trained on "
                           f"{list(self.cfg.vocab)!r}")
        return torch.tensor([index[s] for s in instructions], device=device)

    def step(self, feats, instr, state):
        """One control step: exactly one memory read-write transition. feats [B, ...] -> (ctx [B, ...], new_state)."""
        ctx, state = self.context(feats[:, None], instr, state)
        return {k: v[:, 0] for k, v in ctx.items()}, state

    def loss(self, feats, instr, state, state_vec, actions, action_mask, frame_valid):
        """Flow-matching loss of a TBPTT window. feats [B, T, ...], state_vec [B, T, Ds], actions [B, T, C, Da],
        action_mask [B, T, C], frame_valid [B, T]. Gradients run through the whole window (reads, gates, solve);
        only the F valid frames reach the head. -> (sum of their per-frame losses, F [] long, new memory state)."""
        ctx, new_state = self.context(feats, instr, state, frame_valid)  # ctx values [B, T, ...]
        (B, T), sel = frame_valid.shape, frame_valid.reshape(-1)  # sel: [B T]
        pick = lambda x: x.reshape(B * T, *x.shape[2:])[sel]  # [B, T, ...] -> [F, ...]
        per_frame = self.head.fm_loss({k: pick(v) for k, v in ctx.items()}, pick(state_vec),
                                      pick(instr[:, None].expand(B, T)), pick(actions), pick(action_mask))  # [F]
        return per_frame.sum(), sel.sum(), new_state

    def sample(self, ctx, state_vec, instr, noise):
        """Action chunk [B, C, Da] (normalised units) for one frame's context, from noise [B, C, Da]."""
        return self.head.sample(ctx, state_vec, instr, noise, self.cfg.flow_steps)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


# ---- Shared-source pattern: the DiT host -------------------------------------------------------------------------
class DiTBlock(nn.Module):
    """GR00T-style block: adaLN, attention (cross to the frame tokens Y, or self over [state, actions]), LN, MLP."""

    def __init__(self, d, d_ctx, n_heads, cross):
        super().__init__()
        self.cross, self.n_heads = cross, n_heads
        self.norm1, self.q, self.kv = AdaLN(d), nn.Linear(d, d), nn.Linear(d_ctx if cross else d, 2 * d)
        self.o, self.norm2 = nn.Linear(d, d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, temb, y):  # x [B, 1 + C, d], y [B, n, d_ctx]
        h = self.norm1(x, temb)
        k, v = self.kv(y if self.cross else h).chunk(2, -1)
        heads = lambda z: z.unflatten(-1, (self.n_heads, -1)).transpose(1, 2)  # [B, h, *, d/h]
        o = F.scaled_dot_product_attention(heads(self.q(h)), heads(k), heads(v))  # [B, h, 1 + C, d/h]
        x = x + self.o(o.transpose(1, 2).flatten(2))  # [B, 1 + C, d]
        return x + self.mlp(self.norm2(x))


class DiTHead(FlowHead):
    """DiT action head: tokens [state, a_tau^1..C] (learned positions on actions), adaLN on the flow time and the
    instruction, blocks alternating cross-attention to the tokens Y and self-attention. In GR00T the VLM's tokens
    carry the instruction; this tower sees images only, so a learned instruction embedding joins the time embedding."""

    def __init__(self, cfg: HostConfig, d_ctx):
        super().__init__()
        d = cfg.d_model
        self.state_in, self.action_in = nn.Linear(cfg.state_dim, d), nn.Linear(cfg.action_dim, d)
        self.pos = nn.Parameter(0.02 * torch.randn(cfg.chunk, d))
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([DiTBlock(d, d_ctx, cfg.head_heads, cross=(i % 2 == 0))
                                     for i in range(cfg.head_blocks)])
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.action_dim))
        self.instr_cond = nn.Embedding(max(len(cfg.vocab), 1), d)  # instruction -> adaLN conditioning
        self.d = d

    def velocity(self, a_tau, tau, ctx, state_vec, instr):
        temb = self.t_mlp(time_embedding(tau, self.d)) + self.instr_cond(instr)  # [B, d] flow time + instruction
        x = torch.cat([self.state_in(state_vec)[:, None], self.action_in(a_tau) + self.pos], 1)  # [B, 1 + C, d]
        for blk in self.blocks:
            x = blk(x, temb, ctx["tokens"])
        return self.out(x[:, 1:])  # [B, C, Da]


class DiTHost(Host):
    """Shared-source pattern (appendix, DiT host): frame tokens are query, key and value sources at once (M = N)."""

    cuda_graphs = True

    def __init__(self, cfg: HostConfig):
        super().__init__(cfg)
        D = self.tower.width
        self.cam_embed = nn.Parameter(0.02 * torch.randn(len(cfg.cameras), 1, D))  # learned camera embedding
        # learned, sin-cos initialised: attention is permutation invariant and a random tower barely encodes position
        self.patch_pos = nn.Parameter(sincos_2d(self.tower.n_patches, D))  # [P, D]
        self.instr_embed = nn.Embedding(max(len(cfg.vocab), 1), D)  # learned instruction token
        mcfg = DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=cfg.mem_heads, head_dk=cfg.mem_dk, head_dv=cfg.mem_dv,
                          mixer=cfg.mixer)
        self.memory = DRAMStack(mcfg, cfg.mem_depth) if cfg.memory == "dram" else None
        self.head = DiTHead(cfg, D)

    def encode(self, images, instr=None):
        """Frozen tower on all cameras in one call: cam -> uint8 [B, H, W, 3] upright -> tokens [B, n_cam P, D]."""
        x = stack_cameras(images, self.cfg.cameras, self.tower.mean.device)  # [B n_cam, H, W, 3]
        tok = self.tower.patch_tokens(self.tower.preprocess(x))  # [B n_cam, P, D]
        return tok.reshape(-1, len(self.cfg.cameras) * tok.shape[1], tok.shape[2])  # [B, n_cam P, D]

    def context(self, feats, instr, state, frame_valid=None):
        """feats [B, T, n_cam P, D] -> ({"tokens": Y [B, T, n_cam P + 1, D]}, new_state)."""
        (B, T, NP, D), n_cam = feats.shape, len(self.cfg.cameras)
        x = feats.to(self.cam_embed.dtype).view(B, T, n_cam, NP // n_cam, D)  # [B, T, n_cam, P, D]
        x = (x + self.cam_embed + self.patch_pos).reshape(B, T, NP, D)
        lang = self.instr_embed(instr)[:, None, None].expand(B, T, 1, D)  # [B, T, 1, D]
        x = torch.cat([x, lang], 2)  # [B, T, N, D] the frame's token sequence X_t
        if self.memory is not None:
            x, state = self.memory(x, state, None, frame_valid)  # shared source: X^Q = X^K = X^V = X_t
        return {"tokens": x}, state


# ---- Separate-source pattern: the pi0.5-style host ---------------------------------------------------------------
def rope(x, pos):
    """Rotary position embedding (half-split form). x [B, h, n, dh], pos [n] -> rotated x. Position -1 is the
    memory prefix's reserved index: those keys are left unrotated, so every query sees them at the same phase."""
    dh = x.shape[-1]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dh // 2, device=x.device, dtype=torch.float32) / (dh // 2)))
    ang = pos.float().clamp(min=0)[:, None] * freqs[None]  # [n, dh/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class ExpertLayer(nn.Module):
    """Action-expert layer l (pi0-style): its tokens attend, in one softmax, to the memory prefix (reserved RoPE index
    -1: keys unrotated), backbone layer l's native keys/values (positions 0 .. m-1) and their own (m .. m+n-1).
    key_norm: every key RMS-normalised per head (a random tower's keys are ~4x too small for a softmax to single out a
    patch). kv_adapter: layer l's k and v read through learned linear maps, the identity at first (pi0's expert was
    trained with its VLM; this one starts from scratch over fixed random per-head projections)."""

    def __init__(self, d, n_heads, memory, key_norm=True, kv_adapter=True):
        super().__init__()
        self.h, self.key_norm = n_heads, key_norm
        self.kv_adapter = nn.ModuleList([nn.Linear(d, d) for _ in range(2)]) if kv_adapter else None
        for f in self.kv_adapter or ():  # the identity: a fresh expert reads the native k / v
            nn.init.eye_(f.weight)
            nn.init.zeros_(f.bias)
        self.norm1, self.qkv, self.o, self.norm2 = AdaLN(d), nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        if memory:
            self.pre_k, self.pre_v = nn.Linear(d, d), nn.Linear(d, d)  # readout -> prefix keys / values

    def keys(self, x, kv_l, prefix):
        """-> q [B, h, n, dh], keys and values [B, h, M + m + n, dh] and the keys' RoPE positions [M + m + n]."""
        B, n, d = x.shape
        heads = lambda z: z.view(B, z.shape[1], self.h, d // self.h).transpose(1, 2)  # [B, h, *, d/h]
        q, k, v = (heads(z) for z in self.qkv(x).chunk(3, -1))
        kb, vb = kv_l[:, 0].to(x.dtype), kv_l[:, 1].to(x.dtype)  # [B, m, d] backbone layer l's native k / v
        if self.kv_adapter is not None:
            kb, vb = self.kv_adapter[0](kb), self.kv_adapter[1](vb)
        kb, vb = heads(kb), heads(vb)  # [B, h, m, d/h]
        m, M = kb.shape[2], 0 if prefix is None else prefix.shape[1]
        k, v = torch.cat([kb, k], 2), torch.cat([vb, v], 2)  # [B, h, m + n, d/h]
        if M:
            k = torch.cat([heads(self.pre_k(prefix)), k], 2)  # [B, h, M + m + n, d/h]
            v = torch.cat([heads(self.pre_v(prefix)), v], 2)
        if self.key_norm:
            k = F.rms_norm(k, (k.shape[-1],))
        pos = torch.cat([torch.full((M,), -1, device=x.device), torch.arange(m + n, device=x.device)])
        return rope(q, pos[M + m :]), rope(k, pos), v, pos

    def forward(self, x, temb, kv_l, prefix):
        """x [B, n, d] own tokens, kv_l [B, 2, m, d] backbone layer-l native (pre-RoPE) keys/values,
        prefix [B, M, d] fused query-stream readout or None."""
        B, n, d = x.shape
        q, k, v, _ = self.keys(self.norm1(x, temb), kv_l, prefix)
        o = F.scaled_dot_product_attention(q, k, v)  # [B, h, n, d/h]
        x = x + self.o(o.transpose(1, 2).reshape(B, n, d))
        return x + self.mlp(self.norm2(x))


class ExpertHead(FlowHead):
    """pi0-style action expert of the backbone's depth: own tokens [state + instruction, a_tau^1..C], adaLN on the
    flow time and the instruction. In pi0 the VLM's tokens carry the instruction; a random frozen backbone carries it
    as one hashed text token, so a learned instruction embedding joins the time embedding, as in the DiT head."""

    def __init__(self, cfg: HostConfig, d, n_heads, memory):
        super().__init__()
        self.state_in = nn.Linear(cfg.state_dim, d)
        self.instr_embed = nn.Embedding(max(len(cfg.vocab), 1), d)  # learned instruction embedding
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.layers = nn.ModuleList([ExpertLayer(d, n_heads, memory, cfg.key_norm, cfg.kv_adapter)
                                     for _ in range(cfg.vla_layers)])
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.action_dim))
        self.instr_cond = nn.Embedding(max(len(cfg.vocab), 1), d)  # instruction -> adaLN conditioning
        self.d = d

    def velocity(self, a_tau, tau, ctx, state_vec, instr):
        temb = self.t_mlp(time_embedding(tau, self.d)) + self.instr_cond(instr)  # [B, d] flow time + instruction
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
    with backbone layers, a query stream of their own (HostConfig.query), and readouts injected as prefix keys/values
    of the action expert."""

    def __init__(self, cfg: HostConfig):
        super().__init__(cfg)
        vit = self.tower.model
        if not self.tower.is_vit or not hasattr(vit, "blocks"):
            raise ConfigError(f"--host vla needs a ViT backbone with .blocks, {cfg.vision} has none")
        if cfg.vla_layers > len(vit.blocks):
            raise ConfigError(f"--vla-layers {cfg.vla_layers} > {len(vit.blocks)} blocks of {cfg.vision}")
        D, nh = vit.embed_dim, vit.blocks[0].attn.num_heads
        self.D, self.memory = D, None
        if cfg.memory == "dram":
            if cfg.query == "slots":
                self.slots = nn.Parameter(0.02 * torch.randn(cfg.query_slots, D))  # M learned query slots
            if cfg.write_source == "native_kv":  # the backbone's own per-head keys/values, no DRAM projection
                mc = DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=nh, head_dk=D // nh, head_dv=D // nh, kv_proj=False)
            else:
                mc = DRAMConfig(d_q=D, d_k=D, d_v=D, n_heads=cfg.mem_heads, head_dk=cfg.mem_dk, head_dv=cfg.mem_dv)
            n_mem = cfg.mem_depth if cfg.write_source == "last_hidden" else cfg.vla_layers
            self.memory = nn.ModuleList([DRAMLayer(mc) for _ in range(n_mem)])
        self.head = ExpertHead(cfg, D, nh, cfg.memory == "dram")
        # Fixed position + camera code on the patch tokens before the frozen blocks: RoPE shapes where the expert
        # attends, not what a token carries, and a random tower's own position embedding (~0.3 % of the token power)
        # barely says where a patch is. Scaled to the patch embeddings (RMS 0.36 in vit_tiny); fixed, so cacheable.
        n_cam, P = len(cfg.cameras), self.tower.n_patches
        ang = torch.arange(n_cam, dtype=torch.float32)[:, None] / (100.0 ** (torch.arange(D // 2) / (D // 2)))
        cam = torch.cat([ang.sin(), ang.cos()], 1)  # [n_cam, D] 1-D sin-cos code of the camera index
        code = 0.5 * (sincos_2d(P, D)[None] + cam[:, None]) if cfg.pos_code else torch.zeros(n_cam, P, D)
        self.register_buffer("pos_code", code, persistent=False)  # [n_cam, P, D]
        # frozen text embedding: a pseudo-random vector per instruction, seeded by its hash (not the vocabulary's order)
        seeds = [int(hashlib.sha1(s.encode()).hexdigest()[:12], 16) for s in cfg.vocab]
        table = [torch.randn(D, generator=torch.Generator().manual_seed(sd)) for sd in seeds]
        self.register_buffer("text_table", torch.stack(table) if table else torch.zeros(0, D), persistent=False)

    @torch.no_grad()
    def encode(self, images, instr):
        """-> the hidden states h_0 .. h_L [B, (L + 1) n, D] (viewed as [B, L + 1, n, D]): h_0 the blocks' input,
        h_l block l's output (= block l + 1's input); n = 1 + n_cam P. The native keys / values are a frozen linear map
        of h_0 .. h_{L-1} (native_kv), recomputed in context: a frame caches (L + 1) n D values, not 3 L n D."""
        vit = self.tower.model
        x = stack_cameras(images, self.cfg.cameras, self.tower.mean.device)  # [B n_cam, H, W, 3]
        p = vit._pos_embed(vit.patch_embed(self.tower.preprocess(x)))[:, vit.num_prefix_tokens :]  # [B n_cam, P, D]
        p = p.unflatten(0, (-1, len(self.cfg.cameras))) + self.pos_code  # [B, n_cam, P, D]
        B = p.shape[0]
        text = self.text_table[instr.to(self.text_table.device)]  # [B, D] the instructions' frozen text tokens
        h = torch.cat([text[:, None].to(p.dtype), p.reshape(B, -1, self.D)], 1)  # [B, n, D]
        hs = [vit.norm_pre(h)]  # as timm's forward_features before the blocks (a LayerNorm in CLIP-style towers)
        for blk in vit.blocks[: self.cfg.vla_layers]:
            hs.append(blk(hs[-1]))
        return torch.cat(hs, 1)  # [B, (L + 1) n, D]: flat like the DiT tokens, for the cache

    @torch.no_grad()
    def native_kv(self, h):
        """Backbone layer l's native key and value (its attention's qkv projection of norm1(h_l), pre-RoPE, heads
        concatenated; frozen, so no gradient). h [..., L, n, D] the layers' inputs -> [..., L, 2, n, D]."""
        kv = []
        for l, blk in enumerate(self.tower.model.blocks[: self.cfg.vla_layers]):
            w, b = blk.attn.qkv.weight[self.D :], blk.attn.qkv.bias  # rows [k; v] of timm's [q; k; v] projection
            z = F.linear(blk.norm1(h[..., l, :, :]), w, None if b is None else b[self.D :])  # [..., n, 2 D]
            kv.append(torch.stack(z.chunk(2, -1), -3))  # [..., 2, n, D]
        return torch.stack(kv, -4)

    def context(self, feats, instr, state, frame_valid=None):
        """feats [B, T, (L + 1) n, D] -> ({"kv": [B, T, L, 2, n, D], "prefix": [B, T, L_mem, M, D]}, new_state).
        M = n (query frame) or query_slots. Only the query stream evolves across memory layers; the host's own tokens
        are untouched."""
        B, T, LN, D = feats.shape
        L, ws = self.cfg.vla_layers, self.cfg.write_source
        h = feats.view(B, T, L + 1, LN // (L + 1), D)  # [B, T, L + 1, n, D]: h_0 .. h_L
        ctx = {"kv": self.native_kv(h[:, :, :L])}  # [B, T, L, 2, n, D]
        if self.memory is None:
            return ctx, state
        # The query stream (appendix: designated query slots). frame: a copy of the current frame's last hidden tokens,
        # so each token reads what the memory holds about its own content and place (the block now at p asks whether
        # the block at p was cued), as the DiT host's tokens do. slots: M learned constants, whose readout is one fixed
        # linear map of S_{t-1} whatever the frame shows.
        if self.cfg.query == "frame":
            q = h[:, :, L].float()  # [B, T, n, D]
        else:
            q = self.slots.expand(B, T, *self.slots.shape)  # [B, T, M, D]
        # write_centre: a random tower's tokens share ~80 % of their power in one vector, so their keys are nearly
        # parallel (cosine 0.6-0.98) and each frame's joint write replaces the memory along that one direction;
        # trained on them, the write gates close (w < 0.01) and a cue moves the prefix by ~1 % of its norm.
        # Centred over the frame's tokens, the keys are near-orthogonal and the gates write selectively.
        outs, new = [], []
        for l, layer in enumerate(self.memory):
            # hidden: memory layer l writes backbone layer l's output h_{l+1}; last_hidden: every one writes h_L
            out = h[:, :, L if ws == "last_hidden" else l + 1]  # [B, T, n, D]
            xk, xv = ctx["kv"][:, :, l].unbind(2) if ws == "native_kv" else (out, out)  # [B, T, n, D] each
            if self.cfg.write_centre:  # minus the frame's token mean: a pure function of the current frame
                xk, xv = xk - xk.mean(2, keepdim=True), xv - xv.mean(2, keepdim=True)
            q, _, s = layer(q, xk.float(), xv.float(), state[:, l], None, None, frame_valid)  # [B, T, M, D]
            outs.append(q)
            new.append(s)
        ctx["prefix"] = torch.stack(outs[-1:] if ws == "last_hidden" else outs, 2)  # [B, T, L_mem, M, D]
        return ctx, torch.stack(new, 1)


def make_host(name, config: HostConfig):
    config.host = name
    config.__post_init__()  # the host's name and the settings changed since construction are checked again
    return DiTHost(config) if name == "dit" else VLAHost(config)


# ---- Checkpoints: the host's config and trained weights (+ train.py's state to resume exactly) -------------------
def save_checkpoint(path, obj):
    """Atomic and durable: write <path>.tmp<pid>, flush it to the disk, rename it over `path`, flush the folder: neither
    a kill nor a power loss leaves a corrupt checkpoint (a kill leaves the temporary file: data.remove_stale_tmp).
    obj: the checkpoint dict, or the Path of a checkpoint file to copy byte for byte."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.copyfile(obj, tmp) if isinstance(obj, Path) else torch.save(obj, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())  # the file's bytes reach the disk before the rename that publishes them
    os.replace(tmp, path)
    if os.name == "posix":  # the rename itself is durable once the folder is flushed (Windows cannot open a folder)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def nonfinite(obj, name=""):
    """Key paths ("model/head.out.1.weight") of the float tensors holding NaN/inf in `obj` (nested dicts, lists,
    tuples). Python numbers are not checked: --clip inf is on purpose."""
    if isinstance(obj, (dict, list, tuple)):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return [bad for k, v in items for bad in nonfinite(v, f"{name}/{k}" if name else str(k))]
    return [name] if torch.is_tensor(obj) and obj.is_floating_point() and not torch.isfinite(obj).all() else []


def read_checkpoint(path):
    """-> ckpt dict on the CPU (stats as float32 numpy arrays), ckpt["file_sha1"] naming the file's bytes. Read with
    weights_only: tensors and plain values only, no code from the file runs. A file that is not a train.py checkpoint
    (truncated, another format, other objects, NaN/inf in any tensor) raises data.DataError naming it and the key."""
    raw = Path(path).read_bytes()
    try:
        ck = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only's refusal is a page of advice: keep its reason, the WeightsUnpickler line
        reason = " ".join(str(e).split()).split("WeightsUnpickler error:")[-1].split(". ")[0].strip()
        raise data.DataError(f"{path} is not a readable checkpoint ({type(e).__name__}: {reason}); it is read as "
                             f"tensors and plain values only, never as code: train it with train.py") from e
    for k in ("config", "model", "stats", "instructions", "tower_fingerprint"):
        if not isinstance(ck, dict) or k not in ck:
            raise data.DataError(f"{path} is not a train.py checkpoint (no '{k}')")
    if bad := nonfinite(ck):
        raise data.DataError(f"{path}: {', '.join(bad[:3])} hold NaN/inf; this checkpoint cannot act or resume")
    ck["stats"] = {k: v.numpy() for k, v in ck["stats"].items()}  # data.normalize works on numpy arrays
    ck["file_sha1"] = hashlib.sha1(raw).hexdigest()[:16]
    return ck


def check_config(ck, path, expect):
    """The saved host config must have exactly HostConfig's fields and hold the values of `expect` (field -> value)."""
    fields = HostConfig.__dataclass_fields__
    bad = [f"lacks {f}" for f in fields if f not in ck["config"]] + [f"has {f}" for f in ck["config"] if f not in fields]
    if bad:  # a default filled in here could differ from what the weights were trained with
        raise ConfigError(f"{path}: its host config {', '.join(bad)}; it was written by another train.py, retrain it")
    for k, v in expect.items():
        if ck["config"][k] != v:
            raise ConfigError(f"{path} was trained with {k}={ck['config'][k]!r}, this run has {k}={v!r}")


def load_weights(host, ck, path):
    """Checkpoint `ck`'s trained weights into `host`, whose frozen tower must be the one they were trained with."""
    if host.tower.fingerprint() != ck["tower_fingerprint"]:
        raise ConfigError(f"{path}: the frozen tower built here differs from the one it was trained with "
                          f"({host.cfg.vision}; check --pretrained / --weights-file and the timm version)")
    missing, unexpected = host.load_state_dict(ck["model"], strict=False)
    missing = [k for k in missing if k in {n for n, p in host.named_parameters() if p.requires_grad}]
    if missing or unexpected:
        raise ConfigError(f"{path}: weights do not match the host: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_checkpoint(path, device="cpu", expect=None):
    """-> (host in eval mode, ckpt), the host rebuilt from the saved config; `expect`: config fields that must match."""
    if not Path(path).is_file():
        raise ConfigError(f"checkpoint {path} is not a file: pass a ckpt.pt (train one with `python train.py`)")
    ck = read_checkpoint(path)
    check_config(ck, path, expect or {})
    host = make_host(ck["config"]["host"], HostConfig(**ck["config"])).to(device)
    load_weights(host, ck, path)
    return host.eval(), ck

"""BitNet b1.58 in PyTorch, exactly the forward pass of shared/ground-truth.md, for training and checks.

Every BitLinear runs in one of three modes (set with `BitNetLM.set_mode`):

* ``"qat"``: quantization-aware training. Weights ternarized on the fly by absmean
  (w_t = clamp(round(w / mean|w|), -1, 1)), activations per-token int8 by absmax
  (s = 127 / max(absmax, 1e-5), x_q = clamp(round(x * s), -128, 127)); both through a
  straight-through estimator, so gradients reach the full-precision latent weights unchanged.
  The product is taken on the integer values, y = (x_q @ w_t^T) * mean|w| / s, like the I2_S kernel.
* ``"fp"``: the same latent weights used as a plain float Linear, no activation quantization
  (the model "before ternarization").
* ``"frozen"``: inference from stored ternary codes and scale (buffers `codes`, `scale`), the exact
  content of an I2_S tensor, with the same int8 activation quantization.

Layer math (per block): h = attn_norm(x); q, k, v = BitLinear(h); NEOX RoPE on q, k; causal GQA
attention; x += o_proj(attn_sub_norm(attn)); h = ffn_norm(x); m = relu(gate(h))^2 * up(h);
x += down(ffn_sub_norm(m)). Then output_norm and logits = x @ token_embd^T (tied head).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BitNetConfig:
    vocab_size: int = 4096
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 1536
    context_length: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}")
        for name in ("dim", "ffn_dim"):  # BitLinear input widths: whole I2_S blocks of 128
            if getattr(self, name) % 128:
                problems.append(f"{name} {getattr(self, name)} is not a multiple of 128")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for RoPE")
        if problems:
            raise ValueError("invalid BitNetConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


MODES = ("qat", "fp", "frozen")


def absmean_ternary(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in {-1, 0, 1} as w's dtype, scale = mean|w|) with w ~= codes * scale."""
    scale = w.abs().mean().clamp(min=1e-5)
    return (w / scale).round().clamp(-1, 1), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8: (integer-valued x_q, s) with x ~= x_q / s; float32 math."""
    s = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * s).round().clamp(-128, 127), s


class BitLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # latent full-precision weights
        self.register_buffer("codes", torch.zeros(0, dtype=torch.int8), persistent=False)  # (out, in) frozen
        self.register_buffer("scale", torch.zeros((), dtype=torch.float32), persistent=False)
        # the codes as float32, made once: converting them on every call dominated CPU inference
        self.register_buffer("codes_float", torch.zeros(0), persistent=False)
        self.mode = "qat"

    def freeze(self) -> None:
        """Store the ternary codes and scale of the current latent weights (what the export writes)."""
        with torch.no_grad():
            codes, scale = absmean_ternary(self.weight.float())
        self.codes = codes.to(torch.int8)
        self.codes_float = codes.float()
        self.scale = scale.float()

    def load_ternary(self, codes: torch.Tensor, scale: float) -> None:
        if tuple(codes.shape) != tuple(self.weight.shape):
            raise ValueError(f"ternary codes of shape {tuple(codes.shape)}, expected {tuple(self.weight.shape)}")
        self.codes = codes.to(torch.int8).to(self.weight.device)
        self.codes_float = self.codes.float()
        self.scale = torch.tensor(float(scale), dtype=torch.float32, device=self.weight.device)
        with torch.no_grad():  # latent weights that ternarize to the same codes, for completeness
            self.weight.copy_(self.codes.float() * self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fp":
            return F.linear(x, self.weight)
        xf = x.float()
        x_int, s = quantize_activations(xf)
        xs = xf * s.detach()
        x_ste = xs + (x_int - xs).detach()  # forward: integers; backward: identity (scaled back below)
        if self.mode == "frozen":
            w_ste = self.codes_float
            w_scale = self.scale
        else:
            w = self.weight.float()
            codes, w_scale = absmean_ternary(w)
            w_scale = w_scale.detach()
            wn = w / w_scale
            w_ste = wn + (codes - wn).detach()
        # Integer-valued operands: exact products in bf16 autocast, float32 accumulation.
        y = F.linear(x_ste, w_ste)
        return y * (w_scale / s.detach())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(n: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()  # (T, head_dim/2) each


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); rotate pairs (i, i + head_dim/2) (rotate-half, NEOX)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: BitNetConfig):
        super().__init__()
        hd = cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.q_proj = BitLinear(cfg.dim, cfg.n_heads * hd)
        self.k_proj = BitLinear(cfg.dim, cfg.n_kv_heads * hd)
        self.v_proj = BitLinear(cfg.dim, cfg.n_kv_heads * hd)
        self.attn_sub_norm = RMSNorm(cfg.n_heads * hd, cfg.norm_eps)
        self.o_proj = BitLinear(cfg.n_heads * hd, cfg.dim)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.gate_proj = BitLinear(cfg.dim, cfg.ffn_dim)
        self.up_proj = BitLinear(cfg.dim, cfg.ffn_dim)
        self.ffn_sub_norm = RMSNorm(cfg.ffn_dim, cfg.norm_eps)
        self.down_proj = BitLinear(cfg.ffn_dim, cfg.dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: list | None = None, index: int = 0
    ) -> torch.Tensor:
        """x (B, T, dim) at positions past..past+T-1, cos/sin for those positions; kv_cache[index]
        holds this layer's (k, v) of the `past` earlier positions and is extended in place."""
        cfg, (bsz, n, _) = self.cfg, x.shape
        hd = cfg.head_dim
        h = self.attn_norm(x)
        q = self.q_proj(h).view(bsz, n, cfg.n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(h).view(bsz, n, cfg.n_kv_heads, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(h).view(bsz, n, cfg.n_kv_heads, hd).transpose(1, 2)
        q, k = apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)
        mask = None
        if kv_cache is not None:
            if index < len(kv_cache):
                k = torch.cat([kv_cache[index][0], k], dim=2)
                v = torch.cat([kv_cache[index][1], v], dim=2)
                kv_cache[index] = (k, v)
            else:
                kv_cache.append((k, v))
            past = k.shape[2] - n
            if past:  # query i (position past+i) sees keys 0..past+i
                mask = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(diagonal=past)
        # scale 1/sqrt(hd); under CUDA autocast the operands go to bf16 (flash attention)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        attn = attn.transpose(1, 2).reshape(bsz, n, cfg.n_heads * hd)
        x = x + self.o_proj(self.attn_sub_norm(attn)).float()
        h = self.ffn_norm(x)
        m = F.relu(self.gate_proj(h)).square() * self.up_proj(h)  # relu^2 gate * up
        return x + self.down_proj(self.ffn_sub_norm(m)).float()


class BitNetLM(nn.Module):
    def __init__(self, cfg: BitNetConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        nn.init.normal_(self.token_embd.weight, std=std)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                # residual-branch outputs scaled down with depth (GPT-2 style)
                is_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                out_scale = 1 / math.sqrt(2 * self.cfg.n_layers) if is_out else 1.0
                nn.init.normal_(p, std=std * out_scale)

    def bitlinears(self) -> list[tuple[str, BitLinear]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, BitLinear)]

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}, expected one of {MODES}")
        for _, m in self.bitlinears():
            if mode == "frozen" and m.codes.numel() == 0:
                m.freeze()
            m.mode = mode

    def forward(self, tokens: torch.Tensor, kv_cache: list | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab) float32. With `kv_cache` (a list, empty at
        the start), tokens continue the cached sequence and their keys/values are appended."""
        n = tokens.shape[1]
        past = kv_cache[0][0].shape[2] if kv_cache else 0
        cos, sin = rope_cos_sin(past + n, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        cos, sin = cos[past:], sin[past:]
        x = self.token_embd(tokens).float()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, kv_cache, i)
        x = self.output_norm(x)
        return F.linear(x, self.token_embd.weight).float()  # tied head


@torch.no_grad()
def greedy_generate(model: BitNetLM, prompt: list[int], n_new: int) -> list[int]:
    """Greedy continuation with a KV cache (prompt in one pass, then one token per step)."""
    if len(prompt) + n_new > model.cfg.context_length:
        raise ValueError(f"{len(prompt)} prompt + {n_new} new tokens exceed the context of {model.cfg.context_length}")
    device = model.token_embd.weight.device
    cache: list = []
    logits = model(torch.tensor([prompt], device=device), cache)
    out: list[int] = []
    for _ in range(n_new):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]], device=device), cache)
    return out

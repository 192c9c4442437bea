"""The DiT denoiser, written from the published architecture (Peebles & Xie 2023; the facts are
collected in shared/reference/dit-facts.md §1). Not copied from any repository.

Modules and names follow the published model so that parameter counts can be checked against
the numbers the reference training script logs (DiT-XL/2: 675,129,632 including the frozen
sin-cos position table).
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """Sin-cos embedding of positions `pos` into `dim` features: [sin(pos·ω), cos(pos·ω)]."""
    omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", pos.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(dim: int, rows: int, cols: int) -> np.ndarray:
    """Fixed 2-D sin-cos position table (rows·cols, dim): half the features encode the column
    coordinate, half the row coordinate (the MAE construction DiT uses)."""
    gw, gh = np.meshgrid(np.arange(cols, dtype=np.float32), np.arange(rows, dtype=np.float32))
    emb_w = sincos_1d(dim // 2, gw)
    emb_h = sincos_1d(dim // 2, gh)
    return np.concatenate([emb_w, emb_h], axis=1)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class PatchEmbed(nn.Module):
    """Conv2d(C, D, kernel=p, stride=p) then flatten to (N, T, D); no norm."""

    def __init__(self, patch: int, in_ch: int, hidden: int):
        super().__init__()
        self.proj = nn.Conv2d(in_ch, hidden, kernel_size=patch, stride=patch, bias=True)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Sinusoidal frequency embedding (size `freq`, max period 10000, [cos, sin]) then an MLP."""

    def __init__(self, hidden: int, freq: int = 256):
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def frequencies(self, t):
        half = self.freq // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * f[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.frequencies(t))


class LabelEmbedder(nn.Module):
    """Class table with one extra null row when labels are dropped for classifier-free guidance."""

    def __init__(self, classes: int, hidden: int, drop: float):
        super().__init__()
        self.classes = classes
        self.drop = drop
        self.embedding_table = nn.Embedding(classes + int(drop > 0), hidden)

    def forward(self, y):
        if self.training and self.drop > 0:
            dropped = torch.rand(y.shape[0], device=y.device) < self.drop
            y = torch.where(dropped, self.classes, y)
        return self.embedding_table(y)


class Attention(nn.Module):
    """Multi-head self-attention as in timm's `Attention` (qkv bias, no qk-norm, no dropout).

    `fused=True` calls `F.scaled_dot_product_attention` (the "memory-efficient" spec mode);
    `fused=False` materialises the probabilities: (q·scale) @ kᵀ, softmax, @ v.
    """

    def __init__(self, hidden: int, heads: int, fused: bool):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim**-0.5
        self.fused = fused
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.proj = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """adaLN-Zero block: shift/scale/gate for attention and MLP from SiLU(c)."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int, fused: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads, fused)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, hidden * mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, patch: int, out_ch: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch * patch * out_ch, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, m: dict, latent_h: int, latent_w: int, fused_attention: bool, checkpoint_blocks=()):
        super().__init__()
        self.in_ch = m["in_channels"]
        self.out_ch = 2 * self.in_ch if m["learn_sigma"] else self.in_ch
        self.patch = m["patch"]
        hidden = m["hidden"]
        self.rows = latent_h // self.patch
        self.cols = latent_w // self.patch
        self.checkpoint_blocks = set(checkpoint_blocks)
        self.x_embedder = PatchEmbed(self.patch, self.in_ch, hidden)
        self.t_embedder = TimestepEmbedder(hidden, m["freq_embed"])
        self.y_embedder = LabelEmbedder(m["num_classes"], hidden, m["class_dropout_prob"])
        pos = torch.from_numpy(sincos_2d(hidden, self.rows, self.cols)).float().unsqueeze(0)
        # Fixed, but an nn.Parameter as in the published model (counted by parameters()).
        self.pos_embed = nn.Parameter(pos, requires_grad=False)
        self.blocks = nn.ModuleList(
            DiTBlock(hidden, m["heads"], m["mlp_ratio"], fused_attention) for _ in range(m["depth"])
        )
        self.final_layer = FinalLayer(hidden, self.patch, self.out_ch)
        self.initialize()

    def initialize(self):
        def xavier(mod):
            if isinstance(mod, nn.Linear):
                nn.init.xavier_uniform_(mod.weight)
                nn.init.zeros_(mod.bias)

        self.apply(xavier)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: modulation and output layers start at zero. Small random values are used
        # instead of exact zeros so that every gradient is non-trivial (memory is the same).
        for blk in list(self.blocks) + [self.final_layer]:
            nn.init.normal_(blk.adaLN_modulation[-1].weight, std=1e-3)
            nn.init.zeros_(blk.adaLN_modulation[-1].bias)
        nn.init.normal_(self.final_layer.linear.weight, std=1e-3)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x):
        n = x.shape[0]
        p, c = self.patch, self.out_ch
        x = x.reshape(n, self.rows, self.cols, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(n, c, self.rows * p, self.cols * p)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for i, blk in enumerate(self.blocks):
            if i in self.checkpoint_blocks:
                x = checkpoint(blk, x, c, use_reentrant=False)
            else:
                x = blk(x, c)
        x = self.final_layer(x, c)
        return self.unpatchify(x)


def param_counts(model: nn.Module) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"reported": total, "trainable": trainable}

"""Rotary position embeddings in Hugging Face's rotate_half convention:

    x' = x * cos(p * f) + rotate_half(x) * sin(p * f),  rotate_half([a, b]) = [-b, a]

with frequencies f_i = theta^(-2i/D) repeated over both halves of the head
(cat(freqs, freqs)), optionally rescaled as Llama 3 ("llama3") or linearly.

cos and sin come from a table built in fixed blocks of positions, in float64
then rounded to float32: a position's values never depend on how many
positions a forward asks for, so prefilling in chunks of any size rotates
every key by exactly the same numbers.
"""

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

TABLE_BLOCK = 1024  # positions per block of the cos/sin table


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: Dict[str, Any]) -> torch.Tensor:
    """transformers' _compute_llama3_parameters: long wavelengths slowed by
    `factor`, short ones kept, the band between interpolated."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelength, high_wavelength = old_context / low, old_context / high
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """The D/2 rotation frequencies (float64), rescaled as `scaling` says.
    Raises ValueError for a rope_scaling kind this model does not know."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError("rope_scaling %r is not supported (default, linear, llama3 are)" % kind)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] -> [-b, a] along the last dimension (HF's rotate_half)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [B, H, L, D] by cos, sin [L, D] (one row per position)."""
    return x * cos + rotate_half(x) * sin


class RotaryTable:
    """cos and sin per position, [positions, head_dim] float32, grown a block
    at a time as positions beyond it are asked for."""

    def __init__(self, head_dim: int, theta: float,
                 scaling: Optional[Dict[str, Any]] = None) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self._cos_blocks: List[torch.Tensor] = []
        self._sin_blocks: List[torch.Tensor] = []
        self._cos = torch.zeros((0, head_dim))
        self._sin = torch.zeros((0, head_dim))

    def _add_block(self) -> None:
        start = len(self._cos_blocks) * TABLE_BLOCK
        positions = torch.arange(start, start + TABLE_BLOCK, dtype=torch.float64)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos_blocks.append(angles.cos().to(torch.float32))
        self._sin_blocks.append(angles.sin().to(torch.float32))

    def cos_sin(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [len(positions), head_dim] float32."""
        if positions.numel() == 0:
            return self._cos[:0], self._sin[:0]
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            while len(self._cos_blocks) * TABLE_BLOCK < needed:
                self._add_block()
            self._cos = torch.cat(self._cos_blocks)
            self._sin = torch.cat(self._sin_blocks)
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

"""Rotary position embeddings (RoPE), as the Llama family uses them.

RoPE encodes a token's position by rotating pairs of query/key features through angles
position × frequency. Because only the *difference* of two positions survives in q·k, a key
rotated once, when it was computed, stays valid forever: that is what makes its K cacheable.

This file computes the frequencies; the rotation itself is an op of the step (``ops/rotary.py``).
Llama 3 stretches the low frequencies for long contexts ("llama3" rope scaling); "linear"
scaling divides every frequency by a factor. Both only change the frequencies, never the rotation.
"""

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequency of each feature pair, [head_dim // 2], float32."""
    # Built on the CPU explicitly: models are constructed on the meta device before loading.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim/2]
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(
        f"rope scaling of type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)

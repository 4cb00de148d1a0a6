"""A solution to lesson 1's exercise, deliberately built differently from ContiguousCache.

reference/model/cache.py reserves max_len rows per layer up front and writes into them. This cache
reserves nothing: each layer keeps a tensor that grows by concatenation. It is exactly as
correct, uses no memory for tokens that never arrive, and pays in another currency:

- ``torch.cat`` cannot extend a tensor in place. Every decode step allocates a new tensor of
  n + 1 rows per layer (for K and for V) and copies the n old rows into it. Generating n tokens
  copies about n²/2 rows per layer: the quadratic cost the cache was meant to remove comes back,
  as memory traffic instead of arithmetic.
- For a moment each step both the old and the new tensor are alive (twice the layer's KV).
- In a server, thousands of sequences would keep freeing and allocating buffers of slightly
  different sizes: the allocator's memory fragments. Fixed-size blocks (lesson 3, paging) give
  both properties at once: nothing reserved in advance, nothing copied as a sequence grows.
"""

import torch

from pagedllm.reference.model.cache import OneSequenceCache


class MyContiguousCache(OneSequenceCache):
    """K and V of one sequence, one growing tensor per layer, appended in position order."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.max_len = max_len  # kept only to refuse growing past it, as ContiguousCache does
        empty = torch.empty((0, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.keys = [empty] * num_layers  # [n, kv_heads, head_dim] per layer; n grows
        self.values = [empty] * num_layers

    @property
    def num_cached_tokens(self) -> int:
        # A token counts as cached once every layer holds it; the last layer stores last.
        return self.keys[-1].shape[0]

    def store_and_fetch(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stored = self.keys[layer].shape[0]
        # Appending only works if the new tokens continue the sequence: positions stored,
        # stored + 1, ... Anything else (a gap, a rewrite) is a bug in the caller.
        expected = torch.arange(stored, stored + k.shape[0], device=positions.device)
        if not torch.equal(positions, expected):
            raise ValueError(f"layer {layer} holds {stored} tokens; new tokens must take "
                             f"positions {stored}..{stored + k.shape[0] - 1}, "
                             f"got {positions.tolist()}")
        if stored + k.shape[0] > self.max_len:
            raise ValueError(f"{stored + k.shape[0]} tokens exceed max_len={self.max_len}")
        self.keys[layer] = torch.cat([self.keys[layer], k])  # copies all old rows (see above)
        self.values[layer] = torch.cat([self.values[layer], v])
        total = self.keys[layer].shape[0]
        return self.keys[layer], self.values[layer], torch.arange(total, device=k.device)

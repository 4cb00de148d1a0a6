"""Where a layer's keys and values live between decode steps.

Attention needs the K and V of every earlier token. Those never change once computed (a token's
K and V depend only on the tokens before it), so they can be stored instead of recomputed. The
model hands each layer's new K/V to the cache object it was given (``attend``, see
``attention.py``); these one-sequence caches do it through one method, ``store_and_fetch``: hand
over the new tokens' K/V, get back everything the new queries may attend to, then attend.
Swapping the cache object changes the memory strategy and never the result.

- ``NoCache`` keeps nothing: every step feeds the whole sequence again (the "before" picture).
- ``ContiguousCache`` reserves one slab per sequence for its maximum length, up front: simple,
  fast, and the starting point of the fragmentation story of the next lessons.
"""

import torch

from ..ops import REFERENCE_BACKEND, causal_attention


# --8<-- [start:one_sequence]
class OneSequenceCache:
    """What the two caches below share: attend = store_and_fetch, then causal
    attention."""

    # the ops the model's layers use (norms, rotary, activation)
    backend = REFERENCE_BACKEND

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        keys, values, key_positions = self.store_and_fetch(layer, positions, k, v)
        return causal_attention(q, keys, values, positions, key_positions, scale,
                                sliding_window)  # [T, heads, head_dim]
# --8<-- [end:one_sequence]


# --8<-- [start:no_cache]
class NoCache(OneSequenceCache):
    """Recompute the whole prefix every step: O(n²) work for n generated tokens."""

    # nothing is stored, so the caller must feed every token each step
    num_cached_tokens = 0

    def store_and_fetch(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return k, v, positions  # attend to exactly the tokens that were fed
# --8<-- [end:no_cache]


# --8<-- [start:contiguous_cache]
class ContiguousCache(OneSequenceCache):
    """One sequence's K and V in slabs reserved for max_len tokens, written in position
    order."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        # [layers, max_len, kv_heads, head_dim]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_cached_tokens = 0  # positions [0, num_cached_tokens) hold valid K/V

    def store_and_fetch(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        end = int(positions[-1]) + 1
        if end > self.max_len:
            raise ValueError(f"position {end - 1} does not fit a cache reserved for "
                             f"{self.max_len} tokens; reserve max_len >= {end}")
        self.k[layer, positions] = k  # k: [T, kv_heads, head_dim]
        self.v[layer, positions] = v
        self.num_cached_tokens = max(self.num_cached_tokens, end)
        # The new queries see the stored prefix and themselves: positions [0, end).
        key_positions = torch.arange(end, device=k.device)
        return self.k[layer, :end], self.v[layer, :end], key_positions
# --8<-- [end:contiguous_cache]

    def nbytes(self) -> int:
        """Bytes reserved, used or not: the cost of reserving for the maximum length."""
        return self.k.nbytes + self.v.nbytes

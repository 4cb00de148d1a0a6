"""Exercise (lesson 1, "The KV cache"): write a KV cache the reference model can use.

The model calls ``store_and_fetch`` once per layer per step (through ``attend``, which
``OneSequenceCache`` in reference/model/cache.py gives you). Your cache must remember every K/V
row it is given and hand back everything the new queries may attend to. Check your work with

    pytest lessons/exercises/test_kv_cache_exercise.py

The test generates 24 greedy tokens with your cache and compares them with generation that uses
no cache at all: they must be identical. It also checks that your cache really stored the tokens
(so that ``generate`` fed only one new token per decode step).

한국어:
연습 문제(1강, "KV 캐시"): 레퍼런스 모델이 쓸 수 있는 KV 캐시 작성하기.

모델은 스텝마다, 레이어마다 한 번 ``store_and_fetch``를 호출합니다(reference/model/cache.py의
``OneSequenceCache``가 제공하는 ``attend``를 통해서). 여러분의 캐시는 받은 K/V 행을 모두 기억하고,
새 쿼리가 어텐션할 수 있는 것을 모두 돌려주어야 합니다. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_kv_cache_exercise.py

테스트는 여러분의 캐시로 그리디 토큰 24개를 생성하고, 캐시를 전혀 쓰지 않는 생성과 비교합니다:
둘은 똑같아야 합니다. 또한 캐시가 정말 토큰을 저장했는지(그래서 ``generate``가 디코드 스텝마다 새
토큰 하나만 넣었는지)도 확인합니다.
"""

import torch

from pagedllm.reference.model.cache import OneSequenceCache


class MyContiguousCache(OneSequenceCache):
    """One sequence's keys and values, for every layer, in position order."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.num_layers = num_layers
        self.max_len = max_len  # the sequence never grows past this many tokens
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # generate() reads this before each step and feeds only tokens[num_cached_tokens:].
        # Positions [0, num_cached_tokens) must hold valid K/V in every layer.
        self.num_cached_tokens = 0
        # TODO: create the storage here, e.g. one tensor for K and one for V, big enough for
        # num_layers x max_len x num_kv_heads x head_dim (the model's dtype and device).

    def store_and_fetch(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V of one layer; return all K/V the new queries may see.

        positions: [T] the new tokens' positions (the whole prompt at prefill, then one token),
        k, v: [T, num_kv_heads, head_dim], already rotated by RoPE.
        Returns keys [S, num_kv_heads, head_dim], values [S, num_kv_heads, head_dim] and
        key_positions [S] for S = every position stored so far in this layer, new ones included.
        """
        # 1. Write k and v of this layer at the rows given by `positions`.
        # 2. Update self.num_cached_tokens: one past the last position stored.
        # 3. Return this layer's K and V for positions 0 .. last position, and those positions
        #    as a tensor (torch.arange) on k's device. Return a slice, not the whole
        #    reservation: the causal mask would hide the unwritten rows, but attention would
        #    still do max_len work at every step (the test checks the shape).
        # The attention mask is built from key_positions, so a wrong position shows up as
        # different tokens in the test.
        raise NotImplementedError("exercise: implement MyContiguousCache.store_and_fetch")

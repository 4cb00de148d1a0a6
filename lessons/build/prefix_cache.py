"""Milestone 4 of the build-it track: prefix caching (lessons/build/04-prefix-caching.md).

Write the class below, then make your BlockManager use it (block_manager.py). Check your work
with

    pytest lessons/build/test_build_prefix_cache.py

The cache maps the content of full blocks to the blocks that hold their K/V. A block's
content is its tokens and every token before it in the sequence: two blocks with the same
tokens after different prefixes hold different K/V. The cache does bookkeeping only; the
block manager decides when to look up, register and evict.

한국어:
엔진 직접 만들기 트랙의 마일스톤 4: 프리픽스 캐싱(lessons/build/04-prefix-caching.md).

아래 클래스를 작성한 뒤, 여러분의 BlockManager가 그것을 쓰게 하세요(block_manager.py). 다음
명령으로 확인하세요:

    pytest lessons/build/test_build_prefix_cache.py

캐시는 가득 찬 블록의 내용을 그 K/V를 담은 블록에 대응시킵니다. 블록의 내용은 그 블록의 토큰과,
시퀀스에서 그 앞에 오는 모든 토큰입니다: 같은 토큰이라도 프리픽스가 다르면 두 블록의 K/V는
다릅니다. 캐시는 장부 관리만 합니다. 언제 조회하고, 등록하고, 축출할지는 블록 관리자가 정합니다.
"""


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size

    @staticmethod
    def key(parent: str | None, token_ids: list[int]) -> str:
        """The key of a full block of token_ids whose preceding block has key parent (None:
        the first block). Equal keys mean equal content, the whole prefix included."""
        raise NotImplementedError("milestone 4: write PrefixCache.key")

    def lookup(self, token_ids: list[int]) -> list[tuple[str, int]]:
        """(key, block) of each block of the longest run of full blocks at the start of
        token_ids that the cache holds, in order. The last token is never covered: its
        logits choose the next token, so the engine always computes it."""
        raise NotImplementedError("milestone 4: write PrefixCache.lookup")

    def register(self, key: str, block: int) -> None:
        """The block holds the computed K/V of content key: later lookups may find it. When
        the key or the block is registered already, the first registration stays."""
        raise NotImplementedError("milestone 4: write PrefixCache.register")

    def evict(self, block: int) -> None:
        """The block is about to hold other tokens: forget what it held (if anything)."""
        raise NotImplementedError("milestone 4: write PrefixCache.evict")

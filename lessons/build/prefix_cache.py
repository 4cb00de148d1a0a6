"""Milestone 4 of the build-it track: prefix caching (lessons/build/04-prefix-caching.md).

Write the class below, then make your BlockManager use it (block_manager.py). Check your work
with

    pytest lessons/build/test_build_prefix_cache.py

The cache maps the content of full blocks to the blocks that hold their K/V. A block's
content is its tokens and every token before it in the sequence: two blocks with the same
tokens after different prefixes hold different K/V. The cache does bookkeeping only; the
block manager decides when to look up, register and evict.
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

"""Prefix caching: finding K/V that an earlier request already computed, by block content.

Two requests that start with the same tokens (a system prompt, few-shot examples, an earlier
turn of the conversation) compute identical K/V for those tokens. Give every *full* block a key
that names its content and everything before it — a hash chained over the parent block's key
and the block's own token ids — and a new request can look its prompt up block by block and
reuse the longest chain it finds instead of computing it again.

- Only full blocks get keys: a partial block's content is still changing.
- At least the prompt's last token is always computed, since its logits pick the first output
  token; a prompt found whole reuses all but its last block.
- A freed block keeps its key and sits in the free list; it is reused while free if a lookup
  finds it, and only forgotten when the allocator hands it out for something else (lazy
  eviction). The free list is least-recently-freed first, and a finished request returns its
  blocks deepest first, so a shared prefix outlives the tails that hung off it.
"""

import hashlib


# --8<-- [start:block_key]
def block_key(parent: str | None, token_ids: list[int]) -> str:
    """The key of a full block: its tokens and, through the parent's key, all tokens
    before."""
    text = f"{parent}|{','.join(map(str, token_ids))}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]
# --8<-- [end:block_key]


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_of: dict[str, int] = {}  # key -> the physical block that holds it
        self.key_of: dict[int, str] = {}  # physical block -> its key
        self.hit_blocks = 0
        self.hit_tokens = 0  # prompt tokens not computed thanks to the cache

    # --8<-- [start:lookup]
    def lookup(self, token_ids: list[int],
               root: str | None = None) -> list[tuple[str, int]]:
        """(key, block) of the longest cached chain of full blocks at the start of
        token_ids, leaving at least the last token to compute. root: the first block's
        parent (a KV cache group's own, so groups never find each other's blocks)."""
        found, parent = [], root
        size = self.block_size
        for i in range((len(token_ids) - 1) // size):
            key = block_key(parent, token_ids[i * size: (i + 1) * size])
            if key not in self.block_of:
                break
            found.append((key, self.block_of[key]))
            parent = key
        return found
    # --8<-- [end:lookup]

    # --8<-- [start:register]
    def register(self, key: str, block: int) -> None:
        """A block's K/V are computed and full: remember them under their key. If another block
        already holds the key (two identical prompts in one step), the first one keeps it."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def evict(self, block: int) -> None:
        """The allocator is handing this block out for new content: forget its key."""
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
    # --8<-- [end:register]

    def record_hit(self, num_blocks: int) -> None:
        self.hit_blocks += num_blocks
        self.hit_tokens += num_blocks * self.block_size

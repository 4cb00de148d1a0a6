"""A solution to lesson 9's exercise: a prefix-caching block pool on plain lists and dicts.

Keys chain: block i's key hashes block i - 1's key and block i's tokens. The lookup walks the
prompt's full blocks (all but the last token) and stops at the first key not cached. Reused
blocks are shared, or taken back out of the free list when free; new blocks come from the front
of the free list, and handing a block out forgets its old key (lazy eviction). After the prefill
every full block without a key gets one, unless another block already holds that key. A freed
request returns its blocks deepest first to the back of the free list: least recently used first.
"""

from collections import deque

from pagedllm.reference.kv.prefix_cache import block_key  # block_key(parent_key, token_ids)


def chain_keys(token_ids: list[int], block_size: int) -> list[str]:
    """The keys of the full blocks of token_ids, in order."""
    keys: list[str] = []
    for i in range(len(token_ids) // block_size):
        keys.append(block_key(keys[-1] if keys else None,
                              token_ids[i * block_size: (i + 1) * block_size]))
    return keys


def replay(events: list[tuple], num_blocks: int, block_size: int) -> list[tuple[list[int], int]]:
    """Replay admissions and frees on a pool of num_blocks blocks; one result per admission."""
    free, refs = deque(range(num_blocks)), [0] * num_blocks
    block_of: dict[str, int] = {}
    key_of: dict[int, str] = {}
    tables: dict = {}
    results = []
    for event in events:
        if event[0] == "free":
            for block in reversed(tables.pop(event[1])):  # deepest first
                refs[block] -= 1
                if refs[block] == 0:
                    free.append(block)  # keeps its key: still findable
            continue
        _, request_id, tokens = event
        found = []
        for key in chain_keys(tokens[:len(tokens) - 1], block_size):  # the last token: computed
            if key not in block_of:
                break
            found.append(block_of[key])
        for block in found:
            if refs[block] == 0:
                free.remove(block)  # freed but cached: take it back
            refs[block] += 1
        blocks = list(found)
        for _ in range(-(-len(tokens) // block_size) - len(found)):
            block = free.popleft()  # least recently used
            refs[block] = 1
            old = key_of.pop(block, None)  # lazy eviction: its old content goes now
            if old is not None:
                del block_of[old]
            blocks.append(block)
        keys = chain_keys(tokens, block_size)  # the prefill ran: full blocks become findable
        for key, block in zip(keys[len(found):], blocks[len(found):], strict=False):
            if key not in block_of and block not in key_of:
                block_of[key], key_of[block] = block, key
        tables[request_id] = blocks
        results.append((list(blocks), len(found) * block_size))
    return results

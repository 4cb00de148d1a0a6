"""Milestones 2 and 4 of the build-it track: the block manager (lessons/build/02-block-manager.md).

Milestone 2: write every method below for prefix_cache=None. Milestone 4 (after you write
prefix_cache.py): make allocate, can_allocate, num_cached_tokens and mark_computed use the
prefix cache when one is given. Check your work with

    pytest lessons/build/test_build_block_manager.py
    pytest lessons/build/test_build_prefix_cache.py      # milestone 4

The manager does bookkeeping only: it never touches a tensor. Blocks are numbered 0 ..
num_blocks - 1; a sequence's block table lists, in order, the blocks that hold its tokens
0 .. block_size - 1, block_size .. 2 * block_size - 1, and so on. Sequences are named by seq_id.

Errors (a refused call changes nothing):
- RuntimeError: allocate or append_slot needs more blocks than are free now. That includes an
  allocation larger than the whole pool: unlike pagedllm's manager (lesson 3, ValueError),
  this one leaves that check to the engine, whose add_request refuses such a request.
- ValueError: a method asked about a sequence that holds no blocks (never allocated, or freed
  already), or allocate or fork given a new seq_id that already holds blocks.

한국어:
엔진 직접 만들기 트랙의 마일스톤 2와 4: 블록 관리자(lessons/build/02-block-manager.md).

마일스톤 2: 아래의 모든 메서드를 prefix_cache=None인 경우로 작성하세요.
마일스톤 4(prefix_cache.py를 작성한 뒤): 프리픽스 캐시가 주어지면 allocate, can_allocate,
num_cached_tokens, mark_computed가 그것을 쓰게 하세요. 다음 명령으로 확인하세요:

    pytest lessons/build/test_build_block_manager.py
    pytest lessons/build/test_build_prefix_cache.py      # 마일스톤 4

관리자는 장부 관리만 합니다: 텐서는 절대 건드리지 않습니다. 블록 번호는 0 .. num_blocks - 1이고,
시퀀스의 블록 테이블은 그 시퀀스의 토큰 0 .. block_size - 1, block_size .. 2 * block_size - 1,
그다음 토큰들을 담은 블록을 순서대로 나열합니다. 시퀀스는 seq_id로 구별합니다.

오류(거부된 호출은 아무것도 바꾸지 않습니다):
- RuntimeError: allocate나 append_slot에 지금 비어 있는 것보다 많은 블록이 필요할 때. 풀 전체보다
  큰 할당도 여기에 들어갑니다: pagedllm의 관리자(3강, ValueError)와 달리, 이 관리자는 그 확인을
  엔진에 맡기고, 엔진의 add_request가 그런 요청을 거부합니다.
- ValueError: 블록을 하나도 가지지 않은 시퀀스(할당된 적이 없거나 이미 해제된 시퀀스)에 대해
  메서드가 물었을 때, 또는 allocate나 fork에 이미 블록을 가진 새 seq_id가 주어졌을 때.
"""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache=None):
        """A pool of num_blocks free blocks of block_size token slots each. prefix_cache: None,
        or a PrefixCache (milestone 4) the manager consults and keeps up to date."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        raise NotImplementedError("milestone 2: write BlockManager.num_free_blocks")

    def ref_count(self, block: int) -> int:
        """How many sequences hold the block (0: free)."""
        raise NotImplementedError("milestone 2: write BlockManager.ref_count")

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None) -> bool:
        """Would allocate(_, num_tokens, token_ids) succeed now?"""
        raise NotImplementedError("milestone 2: write BlockManager.can_allocate")

    def allocate(self, seq_id: int, num_tokens: int,
                 token_ids: list[int] | None = None) -> list[int]:
        """Blocks for a new sequence's first num_tokens tokens (its prompt, or on a recompute
        its prompt and outputs); returns its block table. ValueError if seq_id already holds
        blocks; RuntimeError, changing nothing, if the free blocks are too few, even when
        num_tokens needs more blocks than the whole pool has.

        Milestone 4, with a prefix cache and token_ids (the sequence's tokens): the longest
        run of full blocks the cache holds for these tokens is reused, not recomputed; a
        block another sequence holds then costs no free block."""
        raise NotImplementedError("milestone 2: write BlockManager.allocate")

    def num_cached_tokens(self, seq_id: int) -> int:
        """Leading tokens of the sequence whose K/V its allocation found in the prefix cache:
        0 without a prefix cache (milestone 4)."""
        raise NotImplementedError("milestone 2: write BlockManager.num_cached_tokens")

    def mark_computed(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """The K/V of the sequence's first num_computed tokens (token_ids: all its tokens) are
        in its blocks now. Without a prefix cache: nothing to do. Milestone 4: every full
        block among them becomes findable by later requests."""
        raise NotImplementedError("milestone 2: write BlockManager.mark_computed")

    def can_append(self, seq_id: int) -> bool:
        """Would append_slot(seq_id) succeed now?"""
        raise NotImplementedError("milestone 2: write BlockManager.can_append")

    def append_slot(self, seq_id: int) -> tuple[int, tuple[int, int] | None]:
        """Reserve the slot of the sequence's next token; returns (slot, copy).

        copy is (src, dst) when the block the token goes into was shared with another
        sequence: the sequence now holds dst instead of src, and dst's K/V must be made a
        copy of src's before the token is written (copy-on-write); else None. RuntimeError,
        changing nothing, when a free block is needed and none is left."""
        raise NotImplementedError("milestone 2: write BlockManager.append_slot")

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child becomes a sequence holding exactly the parent's blocks and tokens, sharing
        them (nothing is copied). ValueError if child_id already holds blocks."""
        raise NotImplementedError("milestone 2: write BlockManager.fork")

    def free(self, seq_id: int) -> None:
        """The sequence gives up all its blocks: each loses one holder (a block shared
        through fork stays with the others), and a block nobody holds any more is free again.

        Milestone 4: a freed block stays findable by the prefix cache until it is handed out
        for other tokens. In which order free blocks are handed out is your design; the
        tests check the outcome: after other tokens take some of a freed prompt's blocks, the
        start of that prompt is still found, since more requests share a prompt's start than
        its tail (04-prefix-caching.md names orders that do this)."""
        raise NotImplementedError("milestone 2: write BlockManager.free")

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks, in order (a copy: changing it changes nothing here)."""
        raise NotImplementedError("milestone 2: write BlockManager.block_table")

    def num_tokens(self, seq_id: int) -> int:
        """Token slots the sequence has reserved so far."""
        raise NotImplementedError("milestone 2: write BlockManager.num_tokens")

"""Milestone 2, the block manager: allocation on demand, refusal without corruption, reference
counts, fork and copy-on-write.

    pytest lessons/build/test_build_block_manager.py

Each test runs on the solution and on lessons/build/block_manager.py (skipped until written).
The copy-on-write data test also uses milestone 1's pool: yours once written.
"""

import random

import pytest
import torch
from build_track import refuses

PIECE = "block_manager"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def check_invariants(bm, live: set[int]) -> None:
    """What must hold after any sequence of calls, read through the public methods only."""
    holders: dict[int, int] = {}
    for seq_id in live:
        table = bm.block_table(seq_id)
        assert len(table) == blocks_needed(bm.num_tokens(seq_id), bm.block_size), (
            f"sequence {seq_id} reserved {bm.num_tokens(seq_id)} slots in {len(table)} blocks "
            f"of {bm.block_size}: a sequence holds just the blocks its tokens need"
            f"\n시퀀스 {seq_id}: {bm.block_size}칸 블록 {len(table)}개에 슬롯 "
            f"{bm.num_tokens(seq_id)}개를 잡았습니다. 시퀀스는 토큰에 필요한 만큼의 블록만 "
            "가집니다")
        assert len(set(table)) == len(table), (f"sequence {seq_id} holds a block twice: {table}"
                                               f"\n시퀀스 {seq_id}: 한 블록을 두 번 가집니다: "
                                               f"{table}")
        for block in table:
            holders[block] = holders.get(block, 0) + 1
    for block in range(bm.num_blocks):
        assert bm.ref_count(block) == holders.get(block, 0), (
            f"block {block}: ref_count {bm.ref_count(block)}, but {holders.get(block, 0)} "
            "sequences hold it"
            f"\n블록 {block}: ref_count는 {bm.ref_count(block)}인데, 그 블록을 가진 시퀀스는 "
            f"{holders.get(block, 0)}개입니다")
    assert bm.num_free_blocks == bm.num_blocks - len(holders), (
        f"{bm.num_free_blocks} free blocks reported, {bm.num_blocks - len(holders)} held by "
        "nobody"
        f"\n보고된 빈 블록 {bm.num_free_blocks}개, 아무도 가지지 않은 블록 "
        f"{bm.num_blocks - len(holders)}개")


def test_allocate(impl):
    bm = impl.BlockManager(8, 4)
    table = bm.allocate(0, 9)
    assert len(table) == 3, ("9 tokens in blocks of 4: two full blocks and one more"
                             "\n4칸 블록에 9토큰: 가득 찬 블록 2개와 하나 더")
    assert bm.allocate(1, 4) and len(bm.block_table(1)) == 1, (
        "4 tokens fill exactly one block"
        "\n토큰 4개는 블록 하나를 정확히 채웁니다")
    assert not set(table) & set(bm.block_table(1)), ("two sequences got the same block"
                                                     "\n두 시퀀스가 같은 블록을 받았습니다")
    assert bm.num_free_blocks == 4 and bm.num_tokens(0) == 9
    assert all(bm.ref_count(b) == 1 for b in table)
    bm.block_table(0).append(7)
    assert bm.block_table(0) == table, ("block_table returns a copy: changing it changes nothing"
                                        "\nblock_table은 사본을 돌려줍니다: 사본을 바꿔도 "
                                        "아무것도 바뀌지 않습니다")
    refuses(ValueError, "sequence 0 already holds blocks: allocating it again would lose them",
            bm.allocate, 0, 1)
    check_invariants(bm, {0, 1})


def test_pool_one_block_too_small(impl):
    bm = impl.BlockManager(3, 4)
    assert not bm.can_allocate(13), ("13 tokens need 4 blocks of 4; the pool has 3"
                                     "\n토큰 13개에는 4칸 블록 4개가 필요한데, 풀에는 3개뿐입니다")
    refuses(RuntimeError, "13 tokens need 4 blocks, more than the whole pool of 3: in this "
            "track that is a RuntimeError too, not lesson 3's ValueError (the engine's "
            "add_request refuses such a request)", bm.allocate, 0, 13)
    assert bm.num_free_blocks == 3, ("a refused allocation must change nothing: blocks taken "
                                     "before finding out that too few are free leak forever"
                                     "\n거부된 할당은 아무것도 바꾸면 안 됩니다: 빈 블록이 모자란 "
                                     "것을 알기 전에 가져간 블록은 영영 새어 나갑니다")
    refuses(ValueError, "the refused sequence 0 holds no blocks", bm.block_table, 0)
    assert bm.can_allocate(12)
    bm.allocate(0, 12)
    assert not bm.can_allocate(1) and bm.num_free_blocks == 0
    refuses(RuntimeError, "no block is free", bm.allocate, 1, 1)
    check_invariants(bm, {0})


def test_append_grows_on_demand(impl):
    bm = impl.BlockManager(16, 4)
    bm.allocate(0, 2)
    bm.allocate(1, 5)
    for step in range(12):
        for seq_id in (0, 1):
            before = bm.block_table(seq_id)
            position = bm.num_tokens(seq_id)
            slot, copy = bm.append_slot(seq_id)
            table = bm.block_table(seq_id)
            assert copy is None, ("nothing is shared here: no copy"
                                  "\n여기서는 공유되는 것이 없습니다: 복사 없음")
            grew = position % 4 == 0
            assert len(table) == len(before) + grew, (
                f"step {step}, sequence {seq_id}: token at position {position} "
                f"{'starts' if grew else 'fits in'} a block; blocks went {len(before)} -> "
                f"{len(table)} (a new block exactly when the last one is full)"
                f"\n스텝 {step}, 시퀀스 {seq_id}: 위치 {position}의 토큰은 "
                f"{'새 블록을 시작합니다' if grew else '기존 블록에 들어갑니다'}. 블록 수 "
                f"{len(before)} -> {len(table)} (마지막 블록이 가득 찼을 때만 새 블록)")
            assert table[:len(before)] == before, ("append_slot never moves a held block"
                                                   "\nappend_slot은 이미 가진 블록을 절대 옮기지 "
                                                   "않습니다")
            assert slot == table[position // 4] * 4 + position % 4, (
                f"the slot of position {position} is block_table[{position} // 4] * 4 + "
                f"{position} % 4 = {table[position // 4] * 4 + position % 4}, got {slot}"
                f"\n위치 {position}의 슬롯은 block_table[{position} // 4] * 4 + {position} % 4 = "
                f"{table[position // 4] * 4 + position % 4}인데, 결과는 {slot}")
    check_invariants(bm, {0, 1})


def test_append_when_the_pool_is_empty(impl):
    bm = impl.BlockManager(2, 2)
    bm.allocate(0, 2)
    bm.allocate(1, 1)
    assert bm.can_append(1), ("sequence 1's block has a free slot: no block needed"
                              "\n시퀀스 1의 블록에 빈 슬롯이 있습니다: 블록이 필요 없습니다")
    bm.append_slot(1)
    assert not bm.can_append(0) and not bm.can_append(1)
    refuses(RuntimeError, "sequence 0's block is full and no block is free", bm.append_slot, 0)
    assert bm.num_tokens(0) == 2 and len(bm.block_table(0)) == 1, (
        "a refused append_slot must change nothing"
        "\n거부된 append_slot은 아무것도 바꾸면 안 됩니다")
    bm.free(1)
    assert bm.can_append(0)
    bm.append_slot(0)
    check_invariants(bm, {0})


def test_free_and_free_twice(impl):
    bm = impl.BlockManager(4, 4)
    bm.allocate(0, 6)
    bm.allocate(1, 3)
    bm.free(0)
    assert bm.num_free_blocks == 3
    refuses(ValueError, "sequence 0 was freed already: freeing it twice", bm.free, 0)
    assert bm.num_free_blocks == 3, ("freeing twice must raise and change nothing; a block "
                                     "freed twice would be handed to two sequences"
                                     "\n두 번 해제하면 예외를 일으키고 아무것도 바꾸지 않아야 "
                                     "합니다. 두 번 해제된 블록은 두 시퀀스에 나눠 주어질 "
                                     "것입니다")
    for call in (bm.block_table, bm.num_tokens, bm.append_slot, bm.can_append):
        refuses(ValueError, f"{call.__name__} of sequence 0, which holds no blocks", call, 0)
    check_invariants(bm, {1})


def test_fork_counts_references(impl):
    bm = impl.BlockManager(8, 4)
    parent = bm.allocate(0, 7)
    bm.fork(0, 1)
    assert bm.block_table(1) == parent and bm.num_tokens(1) == 7, (
        "a forked child holds the parent's blocks and tokens"
        "\n포크된 자식은 부모의 블록과 토큰을 가집니다")
    assert all(bm.ref_count(b) == 2 for b in parent), ("each shared block is held twice"
                                                       "\n공유된 블록마다 보유자가 둘입니다")
    assert bm.num_free_blocks == 6, ("fork copies nothing: no block is taken"
                                     "\nfork는 아무것도 복사하지 않습니다: 가져가는 블록이 "
                                     "없습니다")
    refuses(ValueError, "sequence 1 holds blocks already: it cannot be forked into",
            bm.fork, 0, 1)
    bm.free(1)
    assert all(bm.ref_count(b) == 1 for b in parent) and bm.num_free_blocks == 6, (
        "freeing the child leaves the parent's blocks to the parent"
        "\n자식을 해제해도 부모의 블록은 부모에게 남습니다")
    bm.free(0)
    assert bm.num_free_blocks == 8
    check_invariants(bm, set())


def test_a_shared_block_written_twice(impl):
    """Parent and child share a half-full block; each writes its own next token into it."""
    bm = impl.BlockManager(8, 4)
    bm.allocate(0, 6)
    shared = bm.block_table(0)[1]  # positions 4, 5 written; 6, 7 free
    bm.fork(0, 1)
    slot, copy = bm.append_slot(1)
    assert copy is not None, ("the child writes position 6 into a block the parent also reads: "
                              "it must get a copy first (copy-on-write)"
                              "\n자식은 부모도 읽는 블록에 위치 6을 씁니다: 먼저 사본을 받아야 "
                              "합니다(쓰기 시 복사)")
    src, dst = copy
    assert src == shared and dst != shared and dst not in bm.block_table(0)
    assert bm.block_table(1) == bm.block_table(0)[:1] + [dst], (
        "the child's table points at the copy; its other blocks stay shared"
        "\n자식의 테이블은 사본을 가리키고, 나머지 블록은 공유된 채로 남습니다")
    assert slot == dst * 4 + 2, ("the child's token goes into the copy, at offset 2"
                                 "\n자식의 토큰은 사본의 오프셋 2에 들어갑니다")
    assert bm.ref_count(src) == 1 and bm.ref_count(dst) == 1
    slot, copy = bm.append_slot(0)
    assert copy is None, ("the parent alone holds the old block now: it writes in place"
                          "\n이제 옛 블록은 부모 혼자 가집니다: 부모는 제자리에 씁니다")
    assert slot == shared * 4 + 2
    slot, copy = bm.append_slot(1)
    assert copy is None and slot == dst * 4 + 3, ("the copy is the child's own: no second copy"
                                                  "\n사본은 자식만의 것입니다: 두 번째 복사는 "
                                                  "없습니다")
    check_invariants(bm, {0, 1})


def test_three_writers_two_copies(impl):
    bm = impl.BlockManager(8, 4)
    bm.allocate(0, 5)
    bm.fork(0, 1)
    bm.fork(0, 2)
    copies = [bm.append_slot(seq_id)[1] for seq_id in (0, 1, 2)]
    assert copies[0] is not None and copies[1] is not None, (
        "two of three sharers copy"
        "\n공유자 셋 중 둘이 복사합니다")
    assert copies[2] is None, ("the last writer holds the block alone by then: copying it "
                               "would waste a block"
                               "\n마지막으로 쓰는 시퀀스는 그때 블록을 혼자 가집니다: 복사하면 "
                               "블록 하나를 낭비합니다")
    check_invariants(bm, {0, 1, 2})


def test_a_shared_full_block_is_not_copied(impl):
    bm = impl.BlockManager(8, 4)
    parent = bm.allocate(0, 8)
    bm.fork(0, 1)
    _, copy = bm.append_slot(1)
    assert copy is None, ("the shared last block is full: the next token starts a fresh "
                          "block, and nobody writes into the shared one"
                          "\n공유된 마지막 블록은 가득 찼습니다: 다음 토큰은 새 블록을 시작하고, "
                          "아무도 공유 블록에 쓰지 않습니다")
    assert bm.block_table(1)[:2] == parent and len(bm.block_table(1)) == 3
    assert bm.block_table(0) == parent
    check_invariants(bm, {0, 1})


def test_copy_on_write_keeps_both_histories(impl, parts):
    """With milestone 1's pool: after the fork, parent and child each write position 6 into
    what was one block. Each must read back its own history."""
    bm = impl.BlockManager(6, 4)
    k_caches, v_caches = parts.allocate_kv_cache(2, 6, 4, 1, 2)
    rows = torch.arange(8.0).repeat_interleave(2).view(8, 1, 2)  # row p holds p, p
    bm.allocate(0, 6)
    table = bm.block_table(0)
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(6)])
    for layer in range(2):
        parts.store_kv(rows[:6], rows[:6], k_caches[layer], v_caches[layer], slots)
    bm.fork(0, 1)
    for seq_id, value in ((1, 100.0), (0, 200.0)):  # the child first, then the parent
        slot, copy = bm.append_slot(seq_id)
        parts.copy_blocks(k_caches, v_caches, [copy] if copy else [])
        token = torch.full((1, 1, 2), value)
        for layer in range(2):
            parts.store_kv(token, token, k_caches[layer], v_caches[layer], torch.tensor([slot]))
    for seq_id, value in ((0, 200.0), (1, 100.0)):
        table = bm.block_table(seq_id)
        for layer in range(2):
            flat = k_caches[layer].view(-1, 1, 2)
            got = [flat[table[p // 4] * 4 + p % 4, 0, 0].item() for p in range(7)]
            assert got == [0, 1, 2, 3, 4, 5, value], (
                f"sequence {seq_id}, layer {layer}, positions 0..6 read {got}. The child's "
                "token and the parent's must land in different blocks, and the child's copy "
                "must hold the shared tokens (4, 5) before its own is written"
                f"\n시퀀스 {seq_id}, 레이어 {layer}: 위치 0..6에서 읽은 값 {got}. 자식의 토큰과 "
                "부모의 토큰은 서로 다른 블록에 들어가야 하고, 자식의 사본은 자기 토큰을 쓰기 "
                "전에 공유된 토큰(4, 5)을 담고 있어야 합니다")


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_keeps_the_books(impl, seed):
    rng = random.Random(seed)
    bm = impl.BlockManager(24, 3)
    live: set[int] = set()
    next_id = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.2 or not live:
            n = rng.randint(1, 10)
            if bm.can_allocate(n):
                bm.allocate(next_id, n)
                live.add(next_id)
            else:
                refuses(RuntimeError, "can_allocate said no", bm.allocate, next_id, n)
            next_id += 1
        elif action < 0.3:
            parent = rng.choice(sorted(live))
            bm.fork(parent, next_id)
            live.add(next_id)
            next_id += 1
        elif action < 0.45:
            seq_id = rng.choice(sorted(live))
            bm.free(seq_id)
            live.remove(seq_id)
        else:
            seq_id = rng.choice(sorted(live))
            if bm.can_append(seq_id):
                bm.append_slot(seq_id)
            else:
                refuses(RuntimeError, "can_append said no", bm.append_slot, seq_id)
        check_invariants(bm, live)

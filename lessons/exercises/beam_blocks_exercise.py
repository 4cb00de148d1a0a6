"""Exercise (lesson 8, "Beam search on shared blocks"): what one beam step does to the blocks.

After a step of beam search, every surviving (parent beam, token) pair becomes a new beam. The
engine's _beam_step forks each new beam from its parent (it shares every block of the parent,
reference counts up), then frees the whole old generation; at the next step every new beam gets
the slot of its token with append_slot, which copies a shared, partly filled last block before
writing into it (copy-on-write). Write what that does to the physical blocks.

Check your work with

    pytest lessons/exercises/test_beam_blocks_exercise.py

The test runs beam steps with random survivors on the real BlockSpaceManager
(reference/kv/block_manager.py) in the order the engine uses (fork all, free the old beams,
append for every new beam) and compares your answer with the manager's reference counts, free
list and copy-on-write pairs at every step. Until you edit this file the test reports your
version as skipped and checks only the solution.

한국어:
연습 문제(8강, "공유 블록 위의 빔 서치"): 빔 한 스텝이 블록에 하는 일.

빔 서치(beam search)의 한 스텝이 끝나면 살아남은 (부모 빔, 토큰) 쌍이 저마다 새 빔이 됩니다.
엔진의 _beam_step은 새 빔을 저마다 부모에서 포크하고(부모의 블록을 모두 공유하며 참조 카운트가
올라갑니다), 그다음 옛 세대 전체를 해제합니다. 다음 스텝에서 새 빔은 저마다 append_slot으로 자기
토큰의 슬롯을 받는데, append_slot은 공유된, 일부만 찬 마지막 블록에 쓰기 전에 그 블록을
복사합니다(쓰기 시 복사(copy-on-write)). 이것이 물리 블록에 무엇을 하는지 작성하세요.

다음 명령으로 확인하세요:

    pytest lessons/exercises/test_beam_blocks_exercise.py

테스트는 살아남는 빔을 무작위로 골라 실제 BlockSpaceManager(reference/kv/block_manager.py) 위에서
엔진과 같은 순서(모두 포크, 옛 빔 해제, 새 빔마다 append)로 빔 스텝을 돌리고, 매 스텝 여러분의
답을 관리자의 참조 카운트, 빈 블록 목록, 쓰기 시 복사 쌍과 비교합니다. 이 파일을 고치기 전까지
테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""


def beam_step_blocks(tables: list[list[int]], num_tokens: int, block_size: int,
                     parents: list[int]) -> tuple[list[int], list[int], int]:
    """(freed, copied, new_blocks) for one beam step.

    tables: the block table of every current beam (beams share blocks, so a block may appear
    in several tables; nothing outside these beams holds them). Every beam holds num_tokens
    tokens in blocks of block_size slots.
    parents: for each new beam, in order, the index in tables of the beam it extends.

    freed:      the blocks that return to the free list when the old generation is freed,
                sorted;
    copied:     the source block of every copy-on-write the new beams' appends make, sorted
                (a block copied twice appears twice);
    new_blocks: how many blocks the appends take from the free list (fresh blocks and copies).

    Example: one beam [0, 1, 2] holding 10 tokens in blocks of 4, three new beams all extending
    it: nothing is freed, block 2 is copied twice, 2 new blocks.
    """
    # Count references: after the fork and the free, how many new beams hold each block?
    # Then, for each block that is some new beam's last one: is it full, or will the new beams
    # write into it? Only the last writer into a shared block escapes the copy.
    raise NotImplementedError("exercise: implement beam_step_blocks")

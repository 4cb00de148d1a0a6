"""Exercise (lesson 7, "Parallel sampling and copy-on-write"): what sharing saves.

A request asks for n samples of one prompt of prompt_len tokens; sample i generates
output_lens[i] tokens (at least one each), so in the end it holds the K/V of
prompt_len + output_lens[i] tokens. Blocks have block_size token slots.

Write the two functions below: how many physical blocks the request holds at the end, with the
samples sharing the prompt's blocks (fork, then copy-on-write), and with every sample holding a
copy of its own. Check your work with

    pytest lessons/exercises/test_cow_exercise.py

The test runs the real BlockSpaceManager (reference/kv/block_manager.py): it allocates the prompt,
forks n - 1 children, appends every sample's tokens, and counts the distinct physical blocks in
use. Until you edit this file the test reports your version as skipped and checks only the
solution.

한국어:
연습 문제(7강, "병렬 샘플링과 쓰기 시 복사"): 공유로 아끼는 것.

한 요청이 prompt_len 토큰짜리 프롬프트 하나에 대해 샘플 n개를 요청합니다. 샘플 i는 토큰
output_lens[i]개를 생성하므로(샘플마다 적어도 하나), 끝에는 토큰 prompt_len + output_lens[i]개의
K/V를 가집니다. 블록에는 토큰 슬롯이 block_size개 있습니다.

아래 두 함수를 작성하세요: 샘플들이 프롬프트의 블록을 공유할 때(포크한 뒤 쓰기 시
복사(copy-on-write))와 샘플마다 자기 사본을 가질 때, 요청이 끝에 가지는 물리 블록의 수입니다. 다음
명령으로 확인하세요:

    pytest lessons/exercises/test_cow_exercise.py

테스트는 실제 BlockSpaceManager(reference/kv/block_manager.py)를 돌립니다: 프롬프트를 할당하고,
자식 n - 1개를 포크하고, 샘플마다 토큰을 append한 뒤, 사용 중인 서로 다른 물리 블록을 셉니다. 이
파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""


def blocks_without_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
    """Blocks held when each of the len(output_lens) samples stores the prompt by itself.

    Example: a 10-token prompt, 3 samples of 8 tokens, blocks of 4: each sample holds 18 tokens
    in 5 blocks, so 15 blocks.
    """
    # Each sample is an ordinary sequence of prompt_len + its output tokens.
    # Round up to whole blocks with integer arithmetic (lesson 3's blocks_needed).
    raise NotImplementedError("exercise: implement blocks_without_sharing")


def blocks_with_sharing(prompt_len: int, output_lens: list[int], block_size: int) -> int:
    """Blocks held when the samples fork from one prefilled prompt (copy-on-write).

    Example: the same request holds 11 blocks (lesson 7's figure).
    """
    # Which of the prompt's blocks does nobody ever write into again? Those stay shared: count
    # them once. The prompt's last block, when it is only partly filled, is written by every
    # sample (its first generated token goes there), so each sample ends up with a version of
    # its own: copies for all but the last writer, who keeps the original.
    # Every block after the prompt's belongs to one sample.
    # Check yourself on a prompt that fills its last block exactly, and on one shorter than a
    # block.
    raise NotImplementedError("exercise: implement blocks_with_sharing")

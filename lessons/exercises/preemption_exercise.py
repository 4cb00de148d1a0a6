"""Exercise (lesson 5, "Scheduling and preemption"): a decode step that runs out of blocks.

Running requests decode in arrival order, one token each. A request whose last block is full
needs a free block for its next token. When none is free, someone must give way: write which
requests the reference scheduler preempts, and what recompute and swap do to their blocks
(lesson 5: "When the pool runs out" and "Recompute or swap").

Check your work with

    pytest lessons/exercises/test_preemption_exercise.py

The test runs the real Scheduler (reference/engine/scheduler.py) on a paged pool small enough
to preempt often, in both modes and with CPU pools of several sizes. At every step that only
decodes running requests it compares your answer with what the scheduler did. Until you edit
this file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(5강, "스케줄링과 선점"): 블록이 바닥난 디코드 스텝.

실행 중인 요청은 도착 순서대로 토큰 하나씩 디코드합니다. 마지막 블록이 가득 찬 요청은 다음 토큰을
위해 빈 블록이 하나 필요합니다. 빈 블록이 없으면 누군가 자리를 내주어야 합니다: 레퍼런스
스케줄러가 어떤 요청을 선점(preemption)하는지, 그리고 재계산과 스왑이 그 요청들의 블록에 무엇을
하는지 작성하세요(5강: "풀이 바닥날 때"와 "재계산 또는 스왑").

다음 명령으로 확인하세요:

    pytest lessons/exercises/test_preemption_exercise.py

테스트는 실제 Scheduler(reference/engine/scheduler.py)를 선점이 자주 일어날 만큼 작은 페이지 단위
풀에서, 두 모드 모두로, 여러 크기의 CPU 풀과 함께 돌립니다. 실행 중인 요청을 디코드만 하는
스텝마다 여러분의 답을 스케줄러가 한 일과 비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의
버전을 skipped로 보고하고 해답만 확인합니다.
"""


def decode_step(running: list[tuple[str, int]], num_free_blocks: int, num_free_cpu_blocks: int,
                block_size: int, mode: str) -> dict:
    """One decode step of the running requests, with preemption when the pool runs out.

    running: (request_id, num_cached) for each running request, in arrival order. Each has one
    sequence whose blocks (its own, none shared) hold the K/V of its first num_cached tokens; its
    decode computes token num_cached and needs a slot for it.
    num_free_blocks, num_free_cpu_blocks: free blocks in the GPU pool and in the CPU swap pool.
    mode: "recompute" or "swap", the scheduler's preemption_mode. The token budget is large
    enough for every decode.

    Returns a dict with
      "decoded":     ids of the requests that get their token this step, in the order served;
      "swapped":     ids preempted by swapping their blocks to the CPU pool, in preemption order;
      "recomputed":  ids preempted by recompute, in preemption order;
      "prefill_again": {request_id: tokens its next prefill computes} for each recomputed one;
      "free_blocks", "free_cpu_blocks": free blocks of each pool after the step.

    Example: running [("a", 8), ("b", 5)], no free block, blocks of 4, mode "recompute": a's
    last block is full and b arrived later, so b gives way and a decodes.
    """
    # Keep the requests not served yet in arrival order: the victims come from its far end.
    # A request may end up preempting itself. A victim holds blocks_needed(num_cached) blocks.
    # Swap needs room in the CPU pool for all of them; what happens when there is none?
    raise NotImplementedError("exercise: implement decode_step")

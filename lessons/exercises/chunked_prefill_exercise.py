"""Exercise (lesson 6, "Budgets and chunked prefill"): how one step splits its token budget.

With enable_chunked_prefill=True a step holds at most max_num_batched_tokens tokens, and the
reference scheduler fills it in this order (lesson 6, "Chunked prefill"):

1. The running requests, in arrival order. A request that is decoding computes one token. A
   request whose prompt is only partly computed continues with its next chunk: as many of its
   remaining tokens as the budget still allows. A request that finds the budget spent computes
   nothing this step (and stays running).
2. Then waiting requests are admitted, first come first served, into what is left: one more
   sequence must stay within max_num_seqs (counting every running request), and some budget
   must be left. An admitted prompt longer than what is left starts with a chunk of what fits.

Check your work with

    pytest lessons/exercises/test_chunked_prefill_exercise.py

The test runs the real Scheduler (reference/engine/scheduler.py) with chunked prefill over a
stream of arriving requests, prompts long and short, and compares your split with the
scheduler's at every step. The KV pool is large, so memory never limits a step here. Until you
edit this file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(6강, "예산과 청크 프리필"): 한 스텝이 토큰 예산을 나누는 방식.

enable_chunked_prefill=True이면 한 스텝에는 토큰이 최대 max_num_batched_tokens개 들어가고,
레퍼런스 스케줄러는 다음 순서로 스텝을 채웁니다(6강, "청크 프리필"):

1. 실행 중인 요청을 도착 순서대로. 디코드 중인 요청은 토큰 하나를 계산합니다. 프롬프트가 일부만
   계산된 요청은 다음 청크로 이어 갑니다: 남은 토큰 가운데 예산이 아직 허락하는 만큼입니다. 예산이
   바닥난 뒤의 요청은 이번 스텝에서 아무것도 계산하지 않습니다(실행 중으로는 남습니다).
2. 그다음 남은 예산에 대기 중인 요청을 선착순으로 받아들입니다: 시퀀스가 하나 늘어도
   max_num_seqs를 넘지 않아야 하고(실행 중인 요청 모두 포함), 예산이 조금이라도 남아 있어야
   합니다. 받아들인 프롬프트가 남은 예산보다 길면 들어가는 만큼의 청크로 시작합니다.

다음 명령으로 확인하세요:

    pytest lessons/exercises/test_chunked_prefill_exercise.py

테스트는 실제 Scheduler(reference/engine/scheduler.py)를 청크 프리필을 켜고, 길고 짧은 프롬프트가
섞인 요청이 계속 도착하게 하여 돌리며, 매 스텝 여러분의 분할을 스케줄러의 것과 비교합니다. KV 풀이
크므로 여기서는 메모리가 스텝을 제한하는 일이 없습니다. 이 파일을 고치기 전까지 테스트는 여러분의
버전을 skipped로 보고하고 해답만 확인합니다.
"""


def chunked_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                 max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, int]:
    """{request_id: tokens computed this step}; a request that computes none is left out.

    running: (request_id, uncomputed) for each running request, in arrival order: uncomputed is
    1 for a request that decodes, more for one still in the middle of its prompt.
    waiting: (request_id, prompt_len) for each waiting request, in arrival order.

    Example: two decoding requests, a 100-token prompt waiting, a budget of 32 and max_num_seqs
    8: {"a": 1, "b": 1, "c": 30}.
    """
    # Track the budget left as you go; it decides both the chunks and whether anyone is admitted.
    raise NotImplementedError("exercise: implement chunked_step")

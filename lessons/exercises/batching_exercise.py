"""Exercise (lesson 4, "Static versus continuous batching"): one step of continuous batching.

Every step the scheduler rebuilds the batch from the queues. Write what one step of the
reference scheduler decides, with vLLM's rules and chunked prefill off (lesson 4):

- Requests waiting for their prefill are admitted first come, first served. A request is
  admitted when all three budgets allow it: one more sequence stays within max_num_seqs
  (counting the running ones), its whole prompt fits in what is left of the step's
  max_num_batched_tokens, and the pool has a free block for every block its prompt fills. The
  first request that does not fit stops admission: nobody behind it jumps ahead.
- A step that admitted anyone only prefills: it computes every admitted prompt whole, and the
  running requests get no token in it.
- Otherwise every running request decodes one token, in arrival order, each costing one token
  of the budget (a request that finds the budget spent skips this step and keeps its blocks).
  A decode writes the K/V of the token sampled last step; it takes a new block when the
  request's last block is full.

Check your work with

    pytest lessons/exercises/test_batching_exercise.py

The test runs the real Scheduler (reference/engine/scheduler.py) over a stream of arriving
requests on a paged KV pool and compares your step with the scheduler's at every step it takes
without preemption (preemption is lesson 5's exercise). Until you edit this file the test
reports your version as skipped and checks only the solution.

한국어:
연습 문제(4강, "정적 배치와 연속 배치"): 연속 배치(continuous batching)의 한 스텝.

스케줄러는 스텝마다 큐에서 배치를 새로 짭니다. vLLM의 규칙대로, 청크 프리필을 끈 상태에서 레퍼런스
스케줄러가 한 스텝에 무엇을 결정하는지 작성하세요(4강):

- 프리필을 기다리는 요청은 선착순으로 받아들입니다. 세 가지 예산이 모두 허락할 때 요청을
  받아들입니다: 시퀀스가 하나 늘어도 max_num_seqs를 넘지 않고(실행 중인 시퀀스 포함), 프롬프트
  전체가 그 스텝의 max_num_batched_tokens 중 남은 양에 들어가며, 프롬프트가 채우는 블록마다 풀에
  빈 블록이 하나씩 있어야 합니다. 들어가지 못하는 첫 요청에서 받아들이기가 멈춥니다: 그 뒤의
  누구도 앞질러 가지 않습니다.
- 누군가를 받아들인 스텝은 프리필만 합니다: 받아들인 프롬프트를 모두 통째로 계산하고, 실행 중인
  요청은 그 스텝에서 토큰을 받지 못합니다.
- 그렇지 않으면 실행 중인 요청이 모두 도착 순서대로 토큰 하나씩 디코드하며, 각각 예산에서 토큰
  하나를 씁니다(예산이 바닥난 뒤의 요청은 이번 스텝을 건너뛰고 블록은 그대로 가집니다). 디코드는
  지난 스텝에서 샘플링한 토큰의 K/V를 씁니다. 요청의 마지막 블록이 가득 차 있으면 새 블록을 하나
  받습니다.

다음 명령으로 확인하세요:

    pytest lessons/exercises/test_batching_exercise.py

테스트는 실제 Scheduler(reference/engine/scheduler.py)를 페이지 단위 KV 풀 위에서 계속 도착하는
요청들로 돌리고, 선점 없이 진행되는 모든 스텝에서 여러분의 스텝을 스케줄러의 것과
비교합니다(선점은 5강의 연습 문제입니다). 이 파일을 고치기 전까지 테스트는 여러분의 버전을
skipped로 보고하고 해답만 확인합니다.
"""


def continuous_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]],
                    num_free_blocks: int, block_size: int, max_num_seqs: int,
                    max_num_batched_tokens: int) -> tuple[dict[str, int], int]:
    """One scheduling step: ({request_id: tokens computed this step}, free blocks after it).

    running: (request_id, num_cached) for each running request, in arrival order. Each has one
    sequence whose blocks hold the K/V of its first num_cached tokens; its decode this step
    computes token num_cached (the one sampled at the end of the last step).
    waiting: (request_id, prompt_len) for each waiting request, in arrival order, prompt_len
    being the tokens its prefill computes.
    num_free_blocks: free blocks of block_size slots in the pool. The pool has fewer than 100
    blocks, so vLLM's admission watermark (1 % of the pool) is zero here.

    A request that computes nothing this step is left out of the dict.

    Example: nothing waits, two requests run holding 4 and 5 tokens in blocks of 4, 3 blocks
    are free: ({"a": 1, "b": 1}, 2).
    """
    # Decide first which kind of step this is: that needs the admission loop to run.
    # Two counts change as you admit: the sequences running and the tokens left in the budget.
    # Lesson 3's blocks_needed tells you how many blocks a prompt fills.
    raise NotImplementedError("exercise: implement continuous_step")

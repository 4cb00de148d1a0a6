"""Milestone 3 of the build-it track: the scheduler (lessons/build/03-scheduler.md).

Write schedule and update. Check your work with

    pytest lessons/build/test_build_scheduler.py

The scheduler decides, before every step, which sequences run and how many tokens each
computes, and books their KV blocks through the block manager (yours from milestone 2, or
any object with its methods). It touches no tensor. The rules are vLLM V0's scheduler's (a
step prefills or decodes; V1 mixes both), without chunked prefill or swapping:

- Continuous batching: the batch is rebuilt every step; a finished sequence's place and
  blocks go to a waiting one at the next step.
- A step either prefills or decodes. It admits waiting sequences and prefills them if it can
  admit any; otherwise it decodes every running sequence by one token.
- First come, first served: sequences are admitted in the order they were added; when the
  first waiting one cannot be admitted, nobody behind it is.
- Budgets per step: at most max_num_seqs sequences running, at most max_num_batched_tokens
  tokens computed (a decode costs 1, a prefill every token it computes; a prefill is never
  split), and the blocks the block manager has. The cached count is known only after
  allocate, so a waiting sequence is admitted only if its whole length, len(seq), fits in
  what the step's budget has left; the step then counts the tokens it computes.
- A decode step decodes the running sequences in arrival order while the token budget
  lasts; those left over when it is spent skip the step, keeping their blocks (no
  preemption).
- A sequence admitted gets blocks for all its tokens, and its num_computed_tokens becomes
  what the block manager reports as cached (prefix caching, milestone 4; 0 before): the
  prefill computes the rest.
- Preemption by recompute: when a running sequence cannot get a slot for its next token,
  running sequences not yet scheduled this step (possibly itself) give up all their blocks,
  one at a time, until the slot is found. Which one gives way is your design (vLLM V0 and the
  solution: the latest arrival); the tests check that exactly as many as needed give way. A
  preempted sequence keeps its output tokens, has no K/V any more, and waits at the front of
  the queue; it will be prefilled again, prompt and outputs together.

한국어:
엔진 직접 만들기 트랙의 마일스톤 3: 스케줄러(lessons/build/03-scheduler.md).

schedule과 update를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/build/test_build_scheduler.py

스케줄러는 매 스텝 전에 어떤 시퀀스가 실행되고 각각 토큰을 몇 개 계산할지 정하고, 블록
관리자(마일스톤 2에서 만든 여러분의 것, 또는 같은 메서드를 가진 아무 객체)를 통해 그 시퀀스들의 KV
블록을 잡아 둡니다. 텐서는 건드리지 않습니다. 규칙은 vLLM V0 스케줄러의 것입니다(한 스텝이
프리필이거나 디코드입니다. V1은 둘을 섞습니다. 청크 프리필과 스왑은 없습니다):

- 연속 배치(continuous batching): 배치는 스텝마다 새로 짜입니다. 끝난 시퀀스의 자리와 블록은 다음
  스텝에서 대기 중인 시퀀스에 돌아갑니다.
- 한 스텝은 프리필이거나 디코드입니다. 대기 중인 시퀀스를 하나라도 받아들일 수 있으면 받아들여
  프리필하고, 그렇지 않으면 실행 중인 모든 시퀀스를 토큰 하나씩 디코드합니다.
- 선착순: 시퀀스는 추가된 순서대로 받아들입니다. 대기 중인 첫 시퀀스를 받아들일 수 없으면 그 뒤의
  누구도 받아들이지 않습니다.
- 스텝당 예산: 실행 중인 시퀀스는 최대 max_num_seqs개, 계산하는 토큰은 최대
  max_num_batched_tokens개(디코드는 1, 프리필은 계산하는 토큰 수만큼 들며, 프리필은 결코 나누지
  않습니다), 그리고 블록 관리자가 가진 블록입니다. 캐시된 토큰 수는 allocate한 뒤에야 알 수
  있으므로, 대기 중인 시퀀스는 전체 길이 len(seq)가 그 스텝의 남은 예산에 들어갈 때만
  받아들입니다. 그다음 스텝은 실제로 계산하는 토큰을 셉니다.
- 디코드 스텝은 토큰 예산이 남아 있는 동안 실행 중인 시퀀스를 도착 순서대로 디코드합니다. 예산이
  바닥났을 때 남은 시퀀스는 블록을 그대로 가진 채 그 스텝을 건너뜁니다(선점 없음).
- 받아들인 시퀀스는 모든 토큰에 대한 블록을 받고, 그 num_computed_tokens는 블록 관리자가
  캐시되었다고 보고하는 값이 됩니다(프리픽스 캐싱, 마일스톤 4. 그 전에는 0): 나머지는 프리필이
  계산합니다.
- 재계산에 의한 선점(preemption): 실행 중인 시퀀스가 다음 토큰의 슬롯을 얻지 못하면, 이번 스텝에서
  아직 스케줄되지 않은 실행 중 시퀀스(자기 자신일 수도 있습니다)가 하나씩 블록을 모두 내놓으며,
  슬롯을 찾을 때까지 이를 되풀이합니다. 누가 양보할지는 여러분이 설계합니다(vLLM V0와 해답: 가장
  늦게 도착한 시퀀스). 테스트는 꼭 필요한 만큼만 양보하는지 확인합니다. 선점된 시퀀스는 출력 토큰을
  유지하지만 K/V는 더 이상 없으며, 큐의 맨 앞에서 기다립니다. 그 시퀀스는 프롬프트와 출력을 함께
  다시 프리필합니다.
"""

from collections import deque

from build_types import (  # noqa: F401 - what a scheduler works with
    FINISHED,
    RUNNING,
    WAITING,
    ScheduledSeq,
    SchedulerOutput,
    Sequence,
)


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()  # in arrival order, preempted ones in front
        self.running: list[Sequence] = []  # holding blocks
        self.num_preemptions = 0  # sequences preempted so far

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step: the sequences to run with their token counts, in arrival order
        within the step; the sequences preempted; the (src, dst) block copies that
        append_slot asked for. Sets each sequence's status (build_types.WAITING, RUNNING)."""
        raise NotImplementedError("milestone 3: write Scheduler.schedule")

    def update(self, out: SchedulerOutput, next_tokens: list[int]) -> None:
        """After the step's forward: the tokens out scheduled have K/V now.

        next_tokens: one token for each scheduled sequence whose step reached its last token
        (ScheduledSeq.samples), in the order of out.scheduled. Every scheduled sequence's
        num_computed_tokens moves on, and the block manager is told (mark_computed); the
        sampling ones get their token. A sequence with max_tokens output tokens is finished:
        status build_types.FINISHED, blocks freed, no longer running."""
        raise NotImplementedError("milestone 3: write Scheduler.update")

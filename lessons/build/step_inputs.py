"""Milestone 5 of the build-it track: the step's inputs (lessons/build/05-step-inputs.md).

Write build_step_inputs. Check your work with

    pytest lessons/build/test_build_step_inputs.py

One forward computes every scheduled token of every scheduled sequence, laid end to end in
the order of out.scheduled. This turns the scheduler's decision and the block manager's block
tables into the flat tensors the model and the attention read (build_types.StepInputs).

한국어:
엔진 직접 만들기 트랙의 마일스톤 5: 스텝의 입력(lessons/build/05-step-inputs.md).

build_step_inputs를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/build/test_build_step_inputs.py

포워드 한 번은 스케줄된 모든 시퀀스의 스케줄된 모든 토큰을 out.scheduled의 순서대로 이어 붙여
계산합니다. 이 함수는 스케줄러의 결정과 블록 관리자의 블록 테이블을, 모델과 어텐션이 읽는 평평한
텐서들(build_types.StepInputs)로 바꿉니다.
"""

import torch  # noqa: F401 - the inputs are tensors
from build_types import SchedulerOutput, StepInputs


def build_step_inputs(out: SchedulerOutput, block_manager) -> StepInputs:
    """Call it after schedule() and before update(): sequence seq computes this step its
    tokens from position seq.num_computed_tokens on, item.num_tokens of them.

    input_ids, positions, slot_mapping [T] int64: those tokens, their positions, and the
    slot each one's K/V is written to (from block_manager.block_table and .block_size).
    block_tables [B, max_blocks] int32: each sequence's blocks, padded with 0 to the longest.
    seq_lens [B] int32: tokens each sequence has in the cache once this step's are stored.
    query_start_loc [B + 1] int32: 0, then where each sequence's rows end.
    logits_indices [S] int64: for each sequence that samples this step (item.samples), in
    order, the row of its last token. All on the CPU.
    """
    raise NotImplementedError("milestone 5: write build_step_inputs")

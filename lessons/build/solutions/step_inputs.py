"""Solution of milestone 5: the scheduler's decision as the flat tensors one forward reads."""

import torch
from build_types import SchedulerOutput, StepInputs


def build_step_inputs(out: SchedulerOutput, block_manager) -> StepInputs:
    bs = block_manager.block_size
    ids, positions, slots, tables, seq_lens, starts, logits_indices = [], [], [], [], [], [0], []
    for item in out.scheduled:
        seq = item.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
        table = block_manager.block_table(seq.seq_id)
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        tables.append(table)
        seq_lens.append(end)
        starts.append(len(ids))
        if item.samples:  # the step reaches the last token: its row predicts the next one
            logits_indices.append(len(ids) - 1)
    width = max((len(t) for t in tables), default=0)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),  # [T]
        positions=torch.tensor(positions, dtype=torch.int64),  # [T]
        slot_mapping=torch.tensor(slots, dtype=torch.int64),  # [T]
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32).view(len(tables), width),  # [B, width]
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),  # [B]
        query_start_loc=torch.tensor(starts, dtype=torch.int32),  # [B + 1]
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64))  # [S]

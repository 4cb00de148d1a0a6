"""The step's inputs: everything model execution sees, as tensors, built once per step.

The scheduler decided which sequences run and how many tokens each computes; the KV cache
manager knows where their tokens live. This turns both into flat tensors (vLLM V1's names):

    input_ids [T], positions [T]      the tokens computed this step, sequence after sequence
    slot_mapping [T]                  where each token's K/V goes (-1: padding, not stored)
    block_tables [B, max_blocks]      each sequence's physical blocks, int32, zero-padded
    seq_lens [B]                      tokens in the cache per sequence after this step
    query_start_loc [B + 1]           sequence b's rows are query_start_loc[b]:[b + 1]
    kv_group_metadata                 a hybrid model (several KV cache groups): groups 1..'s
                                      own slot_mapping and block_tables for the same rows
    logits_indices [S (+ P)]          the rows whose logits are sampled: each sequence's last
                                      row when the step reaches its last token — repeated n times
                                      for a prompt that forks into n samples; a sequence with k
                                      proposals (speculative decoding) its last k + 1 rows; then
                                      the P prompt rows of requests with prompt_logprobs
    sampling                          one row of sampling parameters per logits row (and,
                                      with structured outputs, the grammars' token bitmask)

After this, no layer asks the block manager anything or converts anything to a Python list.
"""

from dataclasses import dataclass, field

import torch

from ..model import AttentionMetadata
from ..ops import SamplingMetadata
from ..ops.sampling import SamplingRow
from .prompt_logprobs import PromptLogprobRows, prompt_rows
from .scheduler import ScheduledSeq, SchedulerOutput
from .structured_outputs.grammar import fill_bitmask


@dataclass
class LogitsRow:
    """What one row of the step's logits is for: a scheduled sequence, and which of its
    group's samples draws from it (a prompt of n samples gives n rows, indices 0..n-1)."""

    item: ScheduledSeq
    sample_index: int
    offset: int = 0  # speculative decoding: j, the row after the run's j-th proposal


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    rows: list[LogitsRow]
    sampling: SamplingMetadata
    # prompt_logprobs' rows: logits rows len(rows) onwards, in this order
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    # A model with several KV cache groups: groups 1.. (attn_metadata is group 0's), the
    # same sequences and lengths over each group's own block tables and slots
    kv_group_metadata: tuple[AttentionMetadata, ...] = ()


def _sample_indices(item: ScheduledSeq) -> list[int]:
    group, seq = item.group, item.seq
    if not group.is_beam_search and not seq.output_token_ids and len(group.seqs) == 1:
        return list(range(group.sampling_params.n))  # the prompt's row feeds all n samples
    return [seq.index]


# --8<-- [start:sampling_row]
def _sampling_row(item: ScheduledSeq, index: int, eos_token_id: int | None,
                  offset: int = 0) -> SamplingRow:
    """The row as plain decoding would sample it; at a speculative run's row j, as if
    the sequence already held its first j proposals (its output position, min_tokens
    and penalties count them)."""
    group, seq, params = item.group, item.seq, item.group.sampling_params
    if group.is_beam_search:
        # beams are chosen from logprobs, not sampled
        return SamplingRow(temperature=0.0)
    output = seq.output_token_ids
    if offset:
        output = output + item.spec_token_ids[:offset]
    blocked = []
    if len(output) < params.min_tokens:  # too early to stop
        blocked = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            blocked.append(eos_token_id)
    row = SamplingRow(temperature=params.temperature, top_k=params.top_k,
                      top_p=params.top_p, stream=group.stream_for(index),
                      position=len(output), blocked_token_ids=blocked,
                      num_logprobs=params.logprobs or 0, min_p=params.min_p,
                      repetition_penalty=params.repetition_penalty,
                      presence_penalty=params.presence_penalty,
                      frequency_penalty=params.frequency_penalty,
                      logit_bias=params.logit_bias)
    if row.transforms_logits:  # the penalties look at what the sequence holds
        row.prompt_token_ids = seq.prompt_token_ids
        row.output_token_ids = output
    return row


def _row_matcher(row: LogitsRow):
    """The grammar's parser for a row: the sequence's own, or at a speculative run's
    row j a fork of it that has taken the first j proposals (each of which it accepts:
    the engine cut the proposals where the grammar refused one)."""
    matcher = row.item.seq.matcher
    if matcher is None or not row.offset:
        return matcher
    fork = matcher.fork()
    for token in row.item.spec_token_ids[:row.offset]:
        fork.accept_token(token)
    return fork
# --8<-- [end:sampling_row]


def group_slots_and_tables(sched: SchedulerOutput, kv,
                           kv_cache_group: int) -> tuple[list[int], list[list[int]]]:
    """The step's slot mapping and block tables in one KV cache group: the rows
    prepare_inputs lays out (padding rows store nothing), over that group's blocks."""
    slots, tables = [], []
    for item in sched.scheduled:
        start = item.seq.num_computed_tokens
        end = start + item.num_tokens + len(item.spec_token_ids)
        slots += kv.slot_mapping(item.seq, start, end, kv_cache_group)
        tables.append(kv.block_table(item.seq, kv_cache_group))
    return slots + [-1] * sum(sched.padding_rows), tables


# --8<-- [start:prepare_inputs]
def prepare_inputs(sched: SchedulerOutput, kv, vocab_size: int,
                   eos_token_id: int | None, device: torch.device) -> StepInputs:
    ids, positions, slots, tables, seq_lens, starts = [], [], [], [], [], [0]
    rows, logits_indices, kept, kept_indices = [], [], [], []
    for item in sched.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_tokens
        k = len(item.spec_token_ids)  # proposals computed after the sequence's tokens
        ids += seq.tokens(start, end) + item.spec_token_ids
        positions += range(start, end + k)
        slots += kv.slot_mapping(seq, start, end + k)
        tables.append(kv.block_table(seq))
        seq_lens.append(end + k)
        starts.append(len(ids))
        if item.group.prompt_logprobs is not None:  # asked for: the prompt's rows too
            keep = prompt_rows(item.group, start, end, starts[-2])
            if keep is not None:
                kept.append(keep)
                kept_indices += range(keep.flat_start, keep.flat_start + keep.num)
        # the step reaches the sequence's last token: it predicts the next one
        if item.samples:
            for index in _sample_indices(item):
                for j in range(k + 1):  # one row, or a speculative run's k + 1
                    rows.append(LogitsRow(item, index, j))
                    logits_indices.append(len(ids) - 1 - k + j)
    # static batching computes pad rows, stores and samples none
    for n in sched.padding_rows:
        ids += [0] * n
        positions += range(n)
        slots += [-1] * n

    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)  # [B]
    query_start_loc_cpu = torch.tensor(starts, dtype=torch.int32)  # [B + 1]
    seq_lens_dev, starts_dev = seq_lens_cpu.to(device), query_start_loc_cpu.to(device)

    def metadata(slots: list[int], tables: list[list[int]]) -> AttentionMetadata:
        max_blocks = max((len(t) for t in tables), default=0)
        block_tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables],
            dtype=torch.int32).view(len(tables), max_blocks)  # [B, max_blocks]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),  # [T]
            block_tables=block_tables.to(device), seq_lens=seq_lens_dev,
            query_start_loc=starts_dev, seq_lens_cpu=seq_lens_cpu,
            query_start_loc_cpu=query_start_loc_cpu)

    attn = metadata(slots, tables)
    # a hybrid model's further KV cache groups: the same rows, their own blocks
    more = tuple(metadata(*group_slots_and_tables(sched, kv, g))
                 for g in range(1, kv.num_kv_cache_groups))
    sampling_rows = [_sampling_row(r.item, r.sample_index, eos_token_id, r.offset)
                     for r in rows]
    matchers = [_row_matcher(r) for r in rows]  # a prompt's n rows share its matcher
    bitmask = None
    if any(m is not None for m in matchers):  # structured outputs: the grammars' masks
        bitmask = fill_bitmask(matchers, [r.blocked_token_ids for r in sampling_rows],
                               vocab_size)
    sampling = SamplingMetadata.from_rows(sampling_rows, vocab_size, device, bitmask)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),  # [T]
        positions=torch.tensor(positions, dtype=torch.int64, device=device),  # [T]
        attn_metadata=attn,
        logits_indices=torch.tensor(logits_indices + kept_indices, dtype=torch.int64,
                                    device=device),  # [S + P]
        rows=rows, sampling=sampling, prompt_rows=kept, kv_group_metadata=more)
# --8<-- [end:prepare_inputs]

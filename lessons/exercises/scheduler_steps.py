"""What the scheduler exercises' tests share: requests to queue, and the engine's part of a step.

The tests drive the real Scheduler with no model: after each schedule() they do what the engine
does once the forward is over (tokens computed, a next token drawn, finished requests removed)
with a dummy token, so that only scheduling decides what happens.
"""

from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.engine.scheduler import Scheduler
from pagedllm.reference.engine.sequence import Sequence, SequenceGroup, next_seq_id


def make_group(request_id: str, prompt_len: int, max_tokens: int, arrival: int):
    seq = Sequence(next_seq_id(), list(range(prompt_len)))
    return SequenceGroup(request_id, [seq], SamplingParams(max_tokens=max_tokens),
                         arrival=arrival, seed=arrival)


def finish_step(scheduler: Scheduler, out) -> None:
    """The engine's part after the forward: tokens computed, next tokens drawn, done removed."""
    for item in out.scheduled:
        reaches_end = item.samples
        item.seq.num_computed_tokens += item.num_tokens
        if reaches_end:
            item.seq.output_token_ids.append(7)
    for group in list(scheduler.running):
        if len(group.seqs[0].output_token_ids) >= group.sampling_params.max_tokens:
            scheduler.remove(group)

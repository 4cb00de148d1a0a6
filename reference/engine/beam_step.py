"""One step of beam search inside the engine: every beam's next-token logprobs in, the next
generation of beams out, sharing blocks with their parents (``beam_search.py`` holds the
selection rule; this file is what it does to the sequences and their KV)."""

import torch

from .beam_search import BeamSearchParams, rank_beams, select_beams
from .sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id


# --8<-- [start:beam_step]
def beam_step(group: SequenceGroup, logits: torch.Tensor, kv,
              eos_token_id: int | None, max_model_len: int) -> None:
    """Every beam has its next-token logits [beams, vocab]: keep the best beam_width
    (beam, token) pairs by log-probability; each survivor forks its parent, the old
    beams are freed."""
    params: BeamSearchParams = group.sampling_params
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [beams, vocab]
    beams = group.unfinished_seqs()
    assert len(beams) == logprobs.shape[0], (
        "every beam of a group runs in the same step")
    survivors, finished = select_beams([list(b.output_token_ids) for b in beams],
                                       [b.cumulative_logprob for b in beams], logprobs,
                                       params, eos_token_id)
    group.finished_beams += finished
    new_beams = []
    for parent, token, score in survivors:
        parent_seq = beams[parent]
        child = Sequence(next_seq_id(), list(parent_seq.prompt_token_ids),
                         list(parent_seq.output_token_ids) + [token],
                         num_computed_tokens=parent_seq.num_computed_tokens,
                         status=SequenceStatus.RUNNING, cumulative_logprob=score)
        kv.fork(parent_seq, child)  # shares every block; copy-on-write later
        new_beams.append(child)
        # held by the group from now on (freed if a step fails)
        group.seqs.append(child)
    for beam in beams:  # the old generation goes; blocks its children share remain
        kv.free_seq(beam)
        beam.status = SequenceStatus.FINISHED
    group.seqs = new_beams
    prompt_len = len(beams[0].prompt_token_ids)
    most = max(1, min(params.max_tokens, max_model_len - prompt_len))
    if not new_beams or len(new_beams[0].output_token_ids) >= most:
        for beam in new_beams:
            kv.free_seq(beam)
            beam.status = SequenceStatus.FINISHED
        group.finished_beams = rank_beams(
            group.finished_beams,
            [(list(b.output_token_ids), b.cumulative_logprob) for b in new_beams],
            params)
        # a finished group keeps a sequence for its prompt
        group.seqs = new_beams or beams
# --8<-- [end:beam_step]

"""Beam search on shared blocks.

Beam search keeps the beam_width most likely continuations. Each step every beam proposes its
next tokens, the beam_width best (beam, token) pairs over all beams survive, and each survivor
becomes a new beam: a child of its parent beam. On paged memory a child is a ``fork`` — it
shares every block of its parent, so the prompt and the common history of the beams are stored
once — and when it writes its new token into the shared last block, copy-on-write gives it a
private copy. Parents that no child chose are freed; the blocks only they held go back to the
pool. This is the paper's second sharing pattern (its savings: 37.6–55.2 % on Alpaca).

Scores follow Hugging Face's beam search: a beam's score is the sum of its tokens' logprobs;
each step takes the best 2 × beam_width candidates, an end-of-sequence candidate among the first
beam_width finishes (score divided by length ** length_penalty), and the best beam_width others
go on. At the end the finished and running beams are ranked by length-penalised score. The
search always runs to max_tokens (transformers' early_stopping="never"); transformers' default
stops earlier on a heuristic, which can differ once end-of-sequence tokens appear.
"""

from dataclasses import dataclass, field

import torch

from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import Sequence, SequenceStatus


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # generated tokens (the prompt excluded)
    cum_logprob: float
    score: float  # cum_logprob / len(tokens) ** length_penalty
    text: str | None = None
    finished: bool = False  # ended with end-of-sequence


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


# --8<-- [start:beam_search]
@torch.inference_mode()
def beam_search(engine, prompt_ids: list[int], params: BeamSearchParams) -> BeamSearchOutput:
    """Run one prompt's beam search on the engine's model and paged KV memory."""
    kv, k = engine.kv, params.beam_width
    eos = None if params.ignore_eos else engine.eos_token_id
    root = Sequence(next(engine._seq_ids), list(prompt_ids), status=SequenceStatus.RUNNING)
    kv.manager.allocate(root.seq_id, len(root))
    beams = [(root, 0.0)]  # (sequence, sum of its tokens' logprobs)
    logprobs = _forward(engine, [(root, len(root))])  # [1, vocab]
    finished: list[BeamSearchSequence] = []
    for step in range(params.max_tokens):
        vocab = logprobs.shape[-1]
        totals = (logprobs + torch.tensor([s for _, s in beams])[:, None]).flatten()  # [B*V]
        top_scores, top_ids = torch.topk(totals, min(2 * k, totals.numel()))
        survivors = []
        for rank, (score, flat) in enumerate(zip(top_scores.tolist(), top_ids.tolist(),
                                                 strict=True)):
            parent, token = beams[flat // vocab][0], flat % vocab
            if token == eos:
                if rank < k:  # only a top-k candidate may finish, as in Hugging Face
                    tokens = parent.output_token_ids + [token]
                    finished.append(BeamSearchSequence(
                        tokens, score, score / len(tokens) ** params.length_penalty,
                        finished=True))
                continue
            if len(survivors) < k:
                survivors.append((parent, token, score))
        new_beams = []
        for parent, token, score in survivors:  # each survivor forks its parent's blocks
            child = Sequence(next(engine._seq_ids), list(parent.prompt_token_ids),
                             list(parent.output_token_ids) + [token],
                             num_computed_tokens=parent.num_computed_tokens,
                             status=SequenceStatus.RUNNING)
            kv.fork(parent, child)
            new_beams.append((child, score))
        for parent, _ in beams:  # the old generation goes; blocks its children share remain
            kv.free_seq(parent)
        beams = new_beams
        if step + 1 == params.max_tokens or not beams:
            break
        for child, _ in beams:
            kv.append(child)  # a slot for the new token: copy-on-write if the block is shared
        logprobs = _forward(engine, [(child, 1) for child, _ in beams])  # [B, vocab]
    results = finished + [BeamSearchSequence(
        list(seq.output_token_ids), score,
        score / len(seq.output_token_ids) ** params.length_penalty) for seq, score in beams]
    for seq, _ in beams:
        kv.free_seq(seq)
    results.sort(key=lambda r: r.score, reverse=True)
    return BeamSearchOutput(list(prompt_ids), results[:k])
# --8<-- [end:beam_search]


def _forward(engine, seqs: list[tuple[Sequence, int]]) -> torch.Tensor:
    """Log-probabilities of each sequence's next token after computing its last n tokens."""
    sched = SchedulerOutput()
    for seq, n in seqs:
        sched.scheduled.append(ScheduledSeq(None, seq, n))
    logits = engine._execute(sched)  # [len(seqs), vocab]
    for seq, n in seqs:
        seq.num_computed_tokens += n
    return torch.log_softmax(logits.float(), dim=-1)

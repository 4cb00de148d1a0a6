"""Prompt logprobs: the logprob of every prompt token, and its top k, from the prefill.

The prefill computes a hidden state at every prompt position, and the hidden state at position
p is what predicts token p + 1. Sampling needs only the last one (logits_indices), so the model
normally runs its final norm and LM head on that row alone. A request with
``SamplingParams(prompt_logprobs=k)`` asks for the others too: its prompt rows are appended to
the step's logits_indices after the rows that are sampled, the model returns their logits as
well, and the engine turns them into one entry per prompt token — vLLM's shape::

    RequestOutput.prompt_logprobs = [None,                      # token 0: nothing predicts it
                                     {token_1: lp, top-k...},   # from position 0's logits
                                     ...,
                                     {token_L-1: lp, top-k...}]  # from position L-2's logits

Each dict holds the prompt token's own logprob and the k most likely tokens' (k = 0: the
prompt token's alone), from the raw distribution (log-softmax of the logits, before
temperature, penalties or logit_bias), as vLLM returns them. Beside it,
``RequestOutput.prompt_token_ranks`` holds each prompt token's rank in that distribution
(1: the most likely; None for token 0): vLLM's ``Logprob.rank``, which the top k cannot give
for a token outside them. Requests without prompt_logprobs
add no row and no work.

Across steps. A chunked prefill computes positions [start, end) in a step: its rows are those
of the positions that predict a prompt token not yet in the list, so the entries are collected
chunk by chunk, in order. A request preempted by recompute prefills its prompt again; its
entries are all in by then, so it adds no row: nothing is duplicated or lost (swapping
recomputes nothing). The list is returned once it is complete (None before, in the outputs of
the steps of an unfinished chunked prefill).

Prefix caching. A block found in the prefix cache is not computed, so its positions have no
logits. vLLM (V1, ``KVCacheManager.get_computed_blocks``) skips the prefix-cache lookup for any
request with prompt_logprobs: the whole prompt is computed (its full blocks are still cached,
for later requests). This engine does the same while the request's prompt entries are
incomplete (``SequenceGroup.reads_prefix_cache``), and better after: a request preempted by
recompute once its entries are in reads the cache like any other.
"""

from dataclasses import dataclass

import torch

from .sequence import SequenceGroup

ROWS_PER_CHUNK = 1024  # log-softmax this many rows at once: bounds the float32 copy


@dataclass
class PromptLogprobRows:
    """One sequence's prompt rows in a step: the logits of positions first .. first + num - 1,
    which predict prompt tokens first + 1 .. first + num."""

    group: SequenceGroup
    first: int  # the first position
    num: int
    flat_start: int  # where position `first` is in the step's flat batch of tokens


# --8<-- [start:prompt_rows]
def prompt_rows(group: SequenceGroup, start: int, end: int,
                flat_start: int) -> PromptLogprobRows | None:
    """The rows a step computing positions [start, end) of the group's prompt keeps
    (flat_start: where position start is in the flat batch), or None. Only positions
    predicting a prompt token not yet collected: none after a recompute."""
    wanted = group.prompt_logprobs
    if wanted is None:
        return None
    num_prompt = len(group.seqs[0].prompt_token_ids)
    first, last = max(start, len(wanted) - 1), min(end, num_prompt - 1)
    if first >= last:
        return None
    return PromptLogprobRows(group, first, last - first, flat_start + first - start)
# --8<-- [end:prompt_rows]


# --8<-- [start:collect]
def collect_prompt_logprobs(rows: list[PromptLogprobRows],
                            logits: torch.Tensor) -> None:
    """logits [P, vocab]: the step's prompt rows, in the order of rows. Appends each
    prompt token's entry {token: logprob, **top k} to its group's prompt_logprobs, and
    its rank (1 + how many tokens are more likely) to prompt_token_ranks."""
    if not rows:
        return
    targets = []  # the prompt token each row predicts
    for r in rows:
        targets += r.group.seqs[0].prompt_token_ids[r.first + 1:r.first + 1 + r.num]
    index = torch.tensor(targets, device=logits.device)[:, None]  # [P, 1]
    k = max(r.group.sampling_params.prompt_logprobs for r in rows)
    chosen, ranks, top_ids, top_lps = [], [], [], []
    for i in range(0, len(targets), ROWS_PER_CHUNK):  # bounds the float32 copy
        j = i + ROWS_PER_CHUNK
        lp = torch.log_softmax(logits[i:j].float(), dim=-1)  # [p, vocab]
        own = lp.gather(1, index[i:j])  # [p, 1]
        chosen += own[:, 0].tolist()
        ranks += ((lp > own).sum(dim=-1) + 1).tolist()
        if k:
            values, ids = lp.topk(k, dim=-1)  # [p, k]
            top_ids += ids.tolist()
            top_lps += values.tolist()
    row = 0
    for r in rows:
        k = r.group.sampling_params.prompt_logprobs
        for _ in range(r.num):
            top = zip(top_ids[row][:k], top_lps[row][:k], strict=True) if k else ()
            r.group.prompt_logprobs.append({targets[row]: chosen[row], **dict(top)})
            r.group.prompt_token_ranks.append(ranks[row])
            row += 1
# --8<-- [end:collect]

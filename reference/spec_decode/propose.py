"""Which proposer an engine runs, and the proposals of a step: asked before the step is
scheduled, so that the scheduler can book each sequence's lookahead slots."""

from ..engine.sequence import Sequence
from .ngram import NgramProposer


def make_proposer(config, num_blocks: int):
    """The proposer of ``config.speculative_config`` (None without one). A draft model loads
    its weights here, into a paged cache of its own of ``num_blocks`` blocks."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max,
                             spec.prompt_lookup_min)
    from .draft import DraftModelProposer  # imports the model loader only when needed
    return DraftModelProposer(config, num_blocks)


# --8<-- [start:propose]
def propose(proposer, running, config) -> None:
    """Proposals for every running sequence that decodes, into seq.spec_token_ids: at most
    num_speculative_tokens, and none past max_tokens or max_model_len (the run's last row
    would be wasted); with a grammar, cut at the first token it refuses."""
    k_max = config.speculative_config.num_speculative_tokens
    wanted = []
    for group in running:
        for seq in group.unfinished_seqs():
            seq.spec_token_ids = []
            if group.is_beam_search or seq.is_prefill:
                continue
            left = group.sampling_params.max_tokens - len(seq.output_token_ids) - 1
            k = min(k_max, left, config.max_model_len - len(seq) - 1)
            if k > 0:
                wanted.append((group, seq, k))
    for (_, seq, k), proposals in zip(wanted, proposer.propose(wanted), strict=True):
        seq.spec_token_ids = grammar_prefix(seq, proposals[:k])
# --8<-- [end:propose]


def grammar_prefix(seq: Sequence, proposals: list[int]) -> list[int]:
    """The longest prefix of the proposals the sequence's grammar accepts, token by token
    (all of them without a grammar). A token that would complete it is left to the target
    (no row may follow a finished grammar: it has no next-token mask)."""
    if seq.matcher is None or not proposals:
        return proposals
    fork = seq.matcher.fork()
    kept = []
    for token in proposals:
        if not fork.accept_token(token) or fork.is_terminated():
            break
        kept.append(token)
    return kept

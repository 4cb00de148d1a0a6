"""Speculative decoding, exact: proposers guess the next k tokens of a sequence, one forward of
the target checks them all, and the longest prefix that equals what plain decoding would have
drawn is kept (``pagedllm.reference.ops.spec_decode``). Speculation on or off never changes a
token, greedy or seeded: the sampler's tokens are a function of the logits and of counters.

- ``config.py``   ``speculative_config`` (vLLM's shape), checked before any weight loads;
- ``ngram.py``    prompt lookup: propose what followed the last n tokens where they last occurred;
- ``draft.py``    a small draft model of the same vocabulary, on its own paged cache, drawing
                  with the target's counters (so the two are coupled: Gumbel-max);
- ``metrics.py``  drafts, draft tokens, accepted tokens (per position), vLLM's names;
- ``propose.py``  the engine's proposer, and each step's proposals, cut to the room and grammar.

The engine asks the proposer for each running sequence's proposals before it schedules
(``LLMEngine._propose``); the scheduler books their lookahead slots and gives the rejected ones
back (``Scheduler.update_from_output``); the prefix cache only ever sees accepted tokens.
"""

from .config import SpeculativeConfig, check_speculative_config
from .metrics import SpecDecodeMetrics
from .ngram import NgramProposer

__all__ = ["NgramProposer", "SpecDecodeMetrics", "SpeculativeConfig",
           "check_speculative_config"]

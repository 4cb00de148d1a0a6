"""Prompt lookup (n-gram) proposals: no model at all.

Take the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min); find
where they occurred before, latest first; propose the k tokens that followed them there. Text
that copies from its input — a summary, an edit, code that repeats its identifiers — is full of
such repeats, and each accepted proposal is a step saved. Where nothing matches, nothing is
proposed and the step is a plain decode step (vLLM's ``ngram`` method; transformers'
prompt-lookup decoding).
"""

import numpy as np


# --8<-- [start:ngram]
class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int,
                 prompt_lookup_min: int):
        self.k = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, wanted: list) -> list[list[int]]:
        """wanted: (group, seq, k) per sequence -> each one's proposals."""
        return [self.lookup(seq.token_ids, k) for _, seq, k in wanted]

    def lookup(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens (self.k by default) that followed the latest earlier occurrence
        of the sequence's longest matching suffix; [] when no suffix of min_n tokens or
        more occurred before."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows[i] = tokens[i:i + n] for every start i whose window ends before the
            # suffix itself would (i + n < L)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: what followed it
                return tokens[start:start + k].tolist()
        return []
# --8<-- [end:ngram]

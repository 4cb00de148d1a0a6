"""Grammars compiled against the tokenizer's vocabulary, the token bitmask each step's sampler
applies, and a sequence's matcher advanced by the token it drew (xgrammar's ``GrammarCompiler``
and ``GrammarMatcher``). See the package's docstring for the whole path."""

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...ops.sampling import ONE_BIT
from ..sequence import SequenceStatus
from ..validation import FieldValueError
from .params import (
    FIELD,
    StructuredOutputsParams,
    allows_any_token,
    load_xgrammar,
    xgrammar_reason,
)


class GrammarCache:
    """Compiles grammars against one tokenizer's vocabulary, each spec once (LRU, up to
    ``capacity`` of them).

    JSON schemas are compiled with ``any_whitespace=False`` (", " and ": " between items, no
    other whitespace): a small model given free whitespace can emit it until max_tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None,
                 capacity: int = 256):
        xgr = load_xgrammar()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size,
            stop_token_ids=None if eos_token_id is None else [eos_token_id])
        # one compile at a time; xgrammar's own cache is off (this one is keyed by the spec)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.capacity = capacity
        self.compiled: OrderedDict = OrderedDict()
        self.compiles = 0  # how many times the compiler ran (a cache hit does not count)
        self._lock = threading.Lock()  # the engine thread looks up, the compiler's adds

    def cached(self, spec: StructuredOutputsParams):
        """The compiled grammar of spec if it is cached, else None."""
        with self._lock:
            hit = self.compiled.get(spec.key)
            if hit is not None:
                self.compiled.move_to_end(spec.key)
            return hit

    def get(self, spec: StructuredOutputsParams):
        """The compiled grammar of spec, compiled now if it is not cached."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        try:
            compiled = self.compiler.compile_grammar(spec.to_grammar())
        except RuntimeError as err:
            raise FieldValueError(FIELD, f"{FIELD}.{spec.kind} could not be compiled: "
                                  f"{xgrammar_reason(err)}") from None
        # The params refused a grammar that allows no byte; this vocabulary may still lack
        # every token it allows first (a tokenizer without byte fallback).
        if not allows_any_token(compiled, self.vocab_size):
            raise FieldValueError(FIELD, f"nothing can satisfy {FIELD}.{spec.kind} with this "
                                  "model: no token of its vocabulary may start the output")
        with self._lock:
            self.compiles += 1
            self.compiled[spec.key] = compiled
            if len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        return compiled

    def matcher(self, compiled):
        """A fresh parser at the grammar's start."""
        return load_xgrammar().GrammarMatcher(compiled)


class BackgroundCompiler:
    """The engine's grammars: a cached one at once, a new one compiled on a thread of its
    own. xgrammar releases the GIL while it compiles, so the engine thread goes on stepping
    the other requests meanwhile; the request joins the scheduler once its grammar is
    ready. The vocabulary's table (``GrammarCache``, built by the first structured output:
    0.7 s for a 49152-token vocabulary) is built on that thread too."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        self._table = (tokenizer, vocab_size, eos_token_id)
        self.cache: GrammarCache | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")

    def lookup(self, spec: StructuredOutputsParams):
        """The compiled grammar if it is cached (no thread, no wait), else None."""
        cache = self.cache
        return None if cache is None else cache.cached(spec)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """Compile on the compiler's thread; the future holds the compiled grammar."""
        return self._pool.submit(self._compile, spec)

    def _compile(self, spec: StructuredOutputsParams):
        with self._lock:
            if self.cache is None:
                self.cache = GrammarCache(*self._table)
        return self.cache.get(spec)

    def matcher(self, compiled):
        """A fresh parser at the grammar's start."""
        return load_xgrammar().GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token."""
    return (vocab_size + 31) // 32


# --8<-- [start:fill_bitmask]
def fill_bitmask(matchers: list, blocked: list[list[int]],
                 vocab_size: int) -> torch.Tensor:
    """One bitmask row per logits row, int32 [S, ceil(vocab / 32)]: bit t of row r
    (word t // 32, bit t % 32) is 1 when token t may come next. A row without a grammar
    (matcher None) allows everything (-1 is all ones).

    blocked[r]: the tokens row r blocks for min_tokens (EOS, stop ids). Where the
    grammar allows nothing else (it is complete: only EOS may follow), they are
    unblocked, in place: the grammar's end wins over min_tokens, or the row would have
    no token left to draw.
    """
    mask = torch.full((len(matchers), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for r, matcher in enumerate(matchers):
        if matcher is None:
            continue
        matcher.fill_next_token_bitmask(mask, r)  # the parser's state -> allowed tokens
        if blocked[r]:
            row = mask[r].clone()
            for t in blocked[r]:
                row[t // 32] &= ~ONE_BIT[t % 32]
            if not bool(row.any()):
                blocked[r].clear()
    return mask
# --8<-- [end:fill_bitmask]


def advance(seq, token: int) -> None:
    """The sequence's newest token enters its matcher. A token the grammar refuses (the
    sampler never draws one: only if every token was masked) ends the sequence with
    finish_reason "error"; a grammar that is complete and took its stop token ends it with
    "stop" (also before min_tokens and with ignore_eos: nothing else may follow)."""
    if not seq.matcher.accept_token(token):
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
    elif seq.matcher.is_terminated() and not seq.is_finished:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"

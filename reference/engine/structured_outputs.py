"""Structured outputs: every generated token must keep the text inside a grammar (vLLM's
``structured_outputs``, backed by xgrammar).

A request names one constraint in ``StructuredOutputsParams``: a JSON schema (``json``), any
JSON object (``json_object``), a regular expression (``regex``), one of a list of strings
(``choice``) or an EBNF grammar (``grammar``). Each becomes an xgrammar ``Grammar`` (a choice is
the alternation ``root ::= "a" | "b"``), which is checked when the params are made, so a
malformed one is refused at the door with xgrammar's reason.

The engine compiles the grammar once against the tokenizer's vocabulary (``GrammarCache``:
which tokens can follow which parser states, precomputed), keyed by the spec, so a repeated
schema costs nothing. Every sequence then carries a ``GrammarMatcher``: a parser that has
accepted exactly the sequence's output tokens. Each step it fills one row of a token
bitmask (bit t of the row: may token t come next?) on the CPU, the sampler sets the
forbidden tokens' logits to -inf, and the drawn token advances the matcher. When the grammar
is complete the only token it allows is EOS; accepting it terminates the matcher and ends the
sequence with finish_reason "stop".

Because the matcher has accepted exactly the output tokens, everything that keeps the output
keeps the matcher right: a preemption by recompute (the output is kept and prefilled again)
or by swap needs nothing. n > 1 samples fork from the prompt's sequence before any token is
added: each child gets ``matcher.fork()`` (a deep copy of the parser state). Beam search has no
structured outputs (``BeamSearchParams`` has no such field).
"""

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..ops.sampling import ONE_BIT
from .validation import FieldValueError

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _xgrammar():
    import xgrammar  # imported on first use: it adds most of a second to every import

    return xgrammar


def xgrammar_reason(err: Exception) -> str:
    """xgrammar's message without its C++ preamble ("[08:00:57] /project/cpp/x.cc:94: ")."""
    text = str(err).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    return text.splitlines()[0] if text else type(err).__name__


def _ebnf_string(text: str) -> str:
    """text as an EBNF string literal: quotes, backslashes and control characters escaped."""
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\r", "\\r").replace("\t", "\\t"))
    return f'"{escaped}"'


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, vLLM's names; exactly one field is set."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like), rule `root`
    json_object: bool | None = None  # any JSON object

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise FieldValueError(FIELD, f"{FIELD} needs exactly one of {', '.join(KINDS)}; "
                                  f"got {', '.join(given) if given else 'none'}")
        self.kind = given[0]
        self.source = self._source()
        self.to_grammar()  # xgrammar parses it now: a malformed one is refused here

    def _source(self) -> str:
        """The spec as one canonical text: the cache key and what xgrammar reads."""
        name = f"{FIELD}.{self.kind}"
        value = getattr(self, self.kind)
        if self.kind == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = json.loads(value)
                except json.JSONDecodeError as err:
                    raise FieldValueError(FIELD, f"{name} is not valid JSON: {err}") from None
            if not isinstance(schema, dict | bool):
                raise FieldValueError(FIELD, f"{name} must be a JSON schema (an object), got "
                                     f"{type(schema).__name__}")
            return json.dumps(schema)  # the order of properties is the output's order
        if self.kind == "json_object":
            if value is not True:
                raise FieldValueError(FIELD, f"{name} must be true, got {value!r}")
            return ""
        if self.kind == "choice":
            if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
                raise FieldValueError(FIELD, f"{name} must be a non-empty list of strings, got "
                                     f"{value!r:.60}")
            if any(not isinstance(c, str) or not c for c in value):
                raise FieldValueError(FIELD, f"{name} must hold non-empty strings, got "
                                      f"{value!r:.60}")
            return "root ::= " + " | ".join(_ebnf_string(c) for c in value)
        if not isinstance(value, str) or not value:
            raise FieldValueError(FIELD, f"{name} must be a non-empty string, got {value!r:.60}")
        return value

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by: the same spec compiles once."""
        return self.kind, self.source

    def to_grammar(self):
        """The xgrammar Grammar of the spec (tokenizer-free: parsing only), or a
        FieldValueError with xgrammar's reason."""
        xgr = _xgrammar()
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                "choice": "choice", "grammar": "EBNF grammar"}[self.kind]
        try:
            if self.kind == "json":
                return xgr.Grammar.from_json_schema(self.source, any_whitespace=False)
            if self.kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.source)
            return xgr.Grammar.from_ebnf(self.source)
        except (RuntimeError, ValueError, TypeError) as err:
            raise FieldValueError(FIELD, f"{FIELD}.{self.kind} is not a valid {what}: "
                                  f"{xgrammar_reason(err)}") from None


class GrammarCache:
    """Compiles grammars against one tokenizer's vocabulary, each spec once (LRU, up to
    ``capacity`` of them).

    JSON schemas are compiled with ``any_whitespace=False`` (", " and ": " between items, no
    other whitespace): a small model given free whitespace can emit it until max_tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None,
                 capacity: int = 256):
        xgr = _xgrammar()
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
        with self._lock:
            self.compiles += 1
            self.compiled[spec.key] = compiled
            if len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        return compiled

    def matcher(self, compiled):
        """A fresh parser at the grammar's start."""
        return _xgrammar().GrammarMatcher(compiled)


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
        return _xgrammar().GrammarMatcher(compiled)

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
    from .sequence import SequenceStatus

    if not seq.matcher.accept_token(token):
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
    elif seq.matcher.is_terminated() and not seq.is_finished:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"

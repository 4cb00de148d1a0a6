"""Structured outputs: every generated token must keep the text inside a grammar (vLLM's
``structured_outputs``, backed by xgrammar).

A request names one constraint in ``StructuredOutputsParams``: a JSON schema (``json``), any
JSON object (``json_object``), a regular expression (``regex``), one of a list of strings
(``choice``) or an EBNF grammar (``grammar``). Each becomes an xgrammar ``Grammar`` (a choice is
the alternation ``root ::= "a" | "b"``), which is checked when the params are made, so a
malformed one is refused at the door with xgrammar's reason, as is one nothing satisfies or a
schema past the stated limits (``params.py``); the Grammar is kept for the compile.

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

from .params import FIELD, KINDS, StructuredOutputsParams, xgrammar_reason

__all__ = ["FIELD", "KINDS", "StructuredOutputsParams", "xgrammar_reason"]

"""What a request asks of its output's shape: ``StructuredOutputsParams`` (vLLM's names), checked
when made — a malformed schema, regex or grammar is refused at the door with xgrammar's reason,
and so is one that nothing can satisfy (its start allows no character, not even the end).

Making one converts the spec to xgrammar's ``Grammar`` and keeps it (``to_grammar``): the
compile thread compiles that one and does not convert again. The conversion of a JSON schema
grows about cubically with its nesting (800 levels of ``{"type": "array", "items": ...}``:
over a minute) and faster still with chains of ``$ref``, so a schema is walked first, in
Python, and refused past ``MAX_SCHEMA_DEPTH`` objects and arrays deep or ``MAX_SCHEMA_REFS``
``$ref`` keys; measured on an Intel Xeon (AVX-512, AMX; 2 cores), the slowest schemas at the
limits convert in 0.1 s (127 nested ``items``) and 0.06 s (a chain of 512 ``$ref``). A server
still makes these params off its event loop: a big schema within the limits and the body's
size can take seconds (a 270 KB schema: 0.2 s to convert, 4 s for the check that something
satisfies it).

A leaf: sampling_params imports it, and it imports nothing of the engine but the field-naming
errors, so the params, the sequence and the compile machinery never import one another in a
circle.
"""

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..validation import FieldValueError

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SCHEMA_DEPTH = 128  # objects and arrays nested in a schema's JSON, the outermost included
MAX_SCHEMA_REFS = 512  # "$ref" keys in a schema


def load_xgrammar():
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
        # xgrammar parses it now: a malformed one is refused here, an unsatisfiable one too
        _check_satisfiable(self.key, self.to_grammar(), f"{FIELD}.{self.kind}")

    def __getstate__(self):
        """Pickled (to a data-parallel replica) or copied without the Grammar, which does not
        pickle; the copy converts again when it is compiled."""
        state = dict(self.__dict__)
        state.pop("_grammar", None)
        return state

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
                except (ValueError, RecursionError):  # over 4300 digits; nested past Python
                    raise FieldValueError(FIELD, f"{name} is not JSON this server reads (an "
                                          "integer too long, or nested too deep)") from None
            if not isinstance(schema, dict | bool):
                raise FieldValueError(FIELD, f"{name} must be a JSON schema (an object), got "
                                     f"{type(schema).__name__}")
            _check_schema_size(schema, name)  # before json.dumps: it recurses too
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
        FieldValueError with xgrammar's reason. Converted once, when the params are made;
        kept for the compile thread."""
        grammar = self.__dict__.get("_grammar")
        if grammar is None:
            grammar = self._grammar = self._convert()
        return grammar

    def _convert(self):
        xgr = load_xgrammar()
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


def _check_schema_size(schema, name: str) -> None:
    """Refuse a schema nested past MAX_SCHEMA_DEPTH or with more than MAX_SCHEMA_REFS "$ref"s,
    before xgrammar's conversion (slow past them) sees it. A walk with a stack: the schema may
    be nested as deep as the request's JSON decoder allowed, past Python's recursion limit."""
    stack, refs = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise FieldValueError(FIELD, f"{name} nests objects and arrays more than "
                                  f"{MAX_SCHEMA_DEPTH} deep; a schema may nest at most "
                                  f"{MAX_SCHEMA_DEPTH} (use $defs and $ref for shared parts)")
        if isinstance(value, dict):
            refs += "$ref" in value
            if refs > MAX_SCHEMA_REFS:
                raise FieldValueError(FIELD, f"{name} has more than {MAX_SCHEMA_REFS} $ref "
                                      f"keys; a schema may have at most {MAX_SCHEMA_REFS}")
            value = value.values()
        elif not isinstance(value, list):
            continue
        stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))


# Digests of the specs found satisfiable, most recent last: a repeated spec is not compiled
# against the bytes again (that compile costs what the model's does: 4 s for a 270 KB schema).
_SATISFIABLE: OrderedDict = OrderedDict()
_SATISFIABLE_CAPACITY = 1024
_satisfiable_lock = threading.Lock()


def _check_satisfiable(key: tuple[str, str], grammar, name: str) -> None:
    """Refuse a grammar that nothing satisfies: at its start no byte may come, nor the end
    (``[^\\s\\S]``, ``root ::= root "a"``). Compiled against a vocabulary of the 256 bytes
    (the model's own is the compile thread's), where any text that satisfies the grammar
    starts with an allowed byte. A grammar that allows a start and then runs into a dead end
    is only found by generating: the request ends with finish_reason "error"."""
    digest = hashlib.sha256(repr(key).encode("utf-8", "surrogatepass")).digest()
    with _satisfiable_lock:
        if digest in _SATISFIABLE:
            _SATISFIABLE.move_to_end(digest)
            return
    xgr = load_xgrammar()
    # a compiler per call (0.3 ms to make): concurrent requests' checks do not queue
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b""],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False) \
        .compile_grammar(grammar)
    if not allows_any_token(compiled, 257):
        raise FieldValueError(FIELD, f"nothing can satisfy {name}: it allows no text at all, "
                              "not even the empty text")
    with _satisfiable_lock:
        _SATISFIABLE[digest] = None
        if len(_SATISFIABLE) > _SATISFIABLE_CAPACITY:
            _SATISFIABLE.popitem(last=False)


def allows_any_token(compiled, vocab_size: int) -> bool:
    """Does a fresh matcher of the compiled grammar allow any token (its end included)?"""
    xgr = load_xgrammar()
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
    return bool(mask.any())

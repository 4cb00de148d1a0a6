"""What a request asks of its output's shape: ``StructuredOutputsParams`` (vLLM's names), checked
when made — a malformed schema, regex or grammar is refused at the door with xgrammar's reason.

A leaf: sampling_params imports it, and it imports nothing of the engine but the field-naming
errors, so the params, the sequence and the compile machinery never import one another in a
circle.
"""

import json
import re
from dataclasses import dataclass

from ..validation import FieldValueError

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object")


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

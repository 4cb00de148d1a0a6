"""The training text of the tiny model: documentation that ships with Python itself.

Two sources, both read from the running interpreter, so any machine rebuilds the same corpus
offline (for the same Python version; the shipped model was trained on CPython 3.11.7):

1. ``pydoc_data.topics``: the language reference's topics that ``help()`` shows (79 entries).
2. The docstrings of the standard library's pure-Python modules (modules, classes, functions),
   parsed from their source with ``ast``; test suites, idlelib, tkinter's demos and
   site-packages are skipped.

A document is one topic or one docstring. Every 20th document (by a stable hash of its name)
is held out for validation, so the validation text is never trained on.
"""

import ast
import hashlib
import pydoc_data.topics
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__",
             "ensurepip", "pydoc_data"}
MIN_DOC_CHARS = 80  # one-line docstrings ("Return self.") teach little and repeat a lot
VALIDATION_EVERY = 20


def pydoc_topics() -> list[tuple[str, str]]:
    return [(f"topic:{name}", text.strip()) for name, text in
            sorted(pydoc_data.topics.topics.items())]


def stdlib_docstrings() -> list[tuple[str, str]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if SKIP_DIRS & set(rel.parts) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOC_CHARS:
                name = getattr(node, "name", "<module>")
                docs.append((f"{rel}:{name}:{getattr(node, 'lineno', 0)}", doc.strip()))
    return docs


def is_validation(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % VALIDATION_EVERY == 0


def load_corpus() -> tuple[list[str], list[str]]:
    """(training documents, validation documents)."""
    train, val = [], []
    for name, text in pydoc_topics() + stdlib_docstrings():
        (val if is_validation(name) else train).append(text)
    return train, val


if __name__ == "__main__":
    train, val = load_corpus()
    print(f"{len(train)} training documents ({sum(map(len, train)):,} chars), "
          f"{len(val)} validation documents ({sum(map(len, val)):,} chars)")

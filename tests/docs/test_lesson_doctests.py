"""Every ``>>>`` session in the lessons runs, and prints what the lesson says it prints.

One test per lesson file that has any session. A file's sessions run in order in one namespace
(a later session may use names an earlier one defined), from the repository root, with
``doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE``. Markdown code fences are blanked out before
parsing, so a fence closing a session ends its expected output instead of joining it.
"""

import doctest
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# The English pages: a Korean twin (NAME.ko.md) has the same code, checked by
# test_translations.py, so running its examples again would test nothing new.
LESSONS = sorted(p for p in (ROOT / "lessons").glob("*.md") if not p.name.endswith(".ko.md"))
PROMPT = re.compile(r"^\s*>>>", re.MULTILINE)
FENCE = re.compile(r"^[ \t]*(```|~~~).*$", re.MULTILINE)
WITH_SESSIONS = [path for path in LESSONS if PROMPT.search(path.read_text())]
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _parse(path: Path) -> doctest.DocTest:
    text = FENCE.sub("", path.read_text())  # same line numbers, no fence lines
    return doctest.DocTestParser().get_doctest(text, {"__name__": path.stem}, path.name,
                                               str(path), 0)


def test_lessons_have_sessions():
    assert WITH_SESSIONS, "no lesson has a >>> session: the pattern or the folder is wrong"


@pytest.mark.parametrize("path", WITH_SESSIONS, ids=[p.stem for p in WITH_SESSIONS])
def test_lesson_sessions(path: Path, monkeypatch):
    text = path.read_text()
    assert "doctest: +SKIP" not in text, f"{path.name} skips an example: make it run instead"
    test = _parse(path)
    prompts = len(PROMPT.findall(text))
    assert len(test.examples) == prompts, (
        f"{path.name}: {prompts} lines start with >>> but {len(test.examples)} examples were "
        "parsed; an example was not recognised (indentation?) and would not run")
    monkeypatch.chdir(ROOT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    report: list[str] = []
    try:
        runner = doctest.DocTestRunner(optionflags=OPTIONS)
        result = runner.run(test, out=report.append)
    finally:
        torch.set_num_threads(threads)
        test.globs.clear()
    assert result.attempted == prompts
    assert result.failed == 0, "".join(report)

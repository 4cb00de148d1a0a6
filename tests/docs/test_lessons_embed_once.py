"""Every ``--8<--`` include in the lessons resolves, and no code is shown twice.

The lessons include their code from the tested modules (pymdownx.snippets, paths relative to the
repository root): ``--8<-- "reference/kv/block_manager.py:fork"`` takes the lines between
``# --8<-- [start:fork]`` and ``# --8<-- [end:fork]``. A (file, section) pair is included by one
page, once: a later lesson that needs the same code links to the page that shows it.
"""

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The English pages: a Korean twin (NAME.ko.md) shows the same snippets, which
# test_translations.py checks.
LESSONS = sorted(p for p in (ROOT / "lessons").glob("*.md") if not p.name.endswith(".ko.md"))
INCLUDE = re.compile(r'^[ \t]*--8<--[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def _includes() -> list[tuple[str, int, str, str | None]]:
    """(page, line, file, section or None for a whole file) for every include."""
    found = []
    for page in LESSONS:
        text = page.read_text()
        for m in INCLUDE.finditer(text):
            target = m.group(1)
            file, _, section = target.partition(":")
            found.append((page.name, text.count("\n", 0, m.start()) + 1, file, section or None))
    return found


def test_lessons_include_code():
    assert _includes(), "no --8<-- include found: the pattern or the folder is wrong"


def test_every_include_resolves():
    problems = []
    for page, line, file, section in _includes():
        path = ROOT / file
        if not path.is_file():
            problems.append(f"{page}:{line}: {file} does not exist")
            continue
        if section is None:
            continue
        if section.isdigit() or re.fullmatch(r"[\d,-]+", section):
            continue  # a line range, not a named section
        text = path.read_text()
        start = re.findall(rf"--8<-- \[start:{re.escape(section)}\]", text)
        end = re.findall(rf"--8<-- \[end:{re.escape(section)}\]", text)
        if len(start) != 1 or len(end) != 1:
            problems.append(f"{page}:{line}: {file} has {len(start)} [start:{section}] and "
                            f"{len(end)} [end:{section}] markers, not one of each")
        elif text.index(f"[start:{section}]") > text.index(f"[end:{section}]"):
            problems.append(f"{page}:{line}: {file}'s [end:{section}] comes before its start")
    assert not problems, "\n".join(problems)


def test_no_code_is_shown_twice():
    where = defaultdict(list)
    for page, line, file, section in _includes():
        where[(file, section)].append(f"{page}:{line}")
    twice = {f"{file}:{section}" if section else file: places
             for (file, section), places in where.items() if len(places) > 1}
    assert not twice, ("code included more than once (show it on one page, link to it from the "
                       "others): " + "; ".join(f"{k} in {', '.join(v)}" for k, v in twice.items()))

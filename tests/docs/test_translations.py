"""The Korean edition is kept in step with the English one.

Every English page ``lessons/NAME.md`` has a Korean twin ``lessons/NAME.ko.md`` (the suffix
layout of mkdocs-static-i18n). The prose is translated; what a reader runs, reads as code or
sees as a measurement is not, so the twins must agree on:

* the code blocks, character for character (mermaid diagrams excepted: their labels are prose
  and are translated, so only their number is compared);
* the embedded snippets (``--8<--`` lines), in order: both editions show the same code from the
  same modules, never a copy;
* the figures, in order (the alt text is translated; the Korean page embeds the Korean
  edition of each figure, ``NAME.ko.png`` beside ``NAME.png``);
* the headings, level by level, with the same anchors: a Korean heading keeps the English
  slug as its id (``## 블록 테이블 { #the-block-table }``), so a link to ``03-paging.md#...``
  lands on the same section in both editions;
* the inline code spans (identifiers, flags, file names), as a multiset: Korean word order may
  move them, never change them;
* the admonitions and the formulas, by count;
* the numbers: every number written in the English prose appears in the Korean prose.

The strict build of both editions and the browser test over every page of both are in
test_site_browser.py.
"""

import re
from collections import Counter
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

LESSONS = Path(__file__).resolve().parents[2] / "lessons"
ENGLISH = sorted(p for p in LESSONS.rglob("*.md") if not p.name.endswith(".ko.md"))

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n]*)\n(?P<body>.*?)^"
                   r"(?P=indent)(?P=fence)[ \t]*$", re.S | re.M)
SNIPPET = re.compile(r"^[ \t]*--8<--.*$", re.M)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*$", re.M)
EXPLICIT_ID = re.compile(r"\{[^}]*#([\w-]+)[^}]*\}\s*$")
ADMONITION = re.compile(r"^[ \t]*(?:!!!|\?\?\?\+?)[ \t]+\w+", re.M)
MATH = re.compile(r"\$\$|\\\(|\\\[")
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")
LINK_TARGET = re.compile(r"\]\(([^)\s]*)\)")
# A span may wrap across a line break (markdown allows it): match across lines, compare the
# spans with their whitespace collapsed.
INLINE_CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def _twin(page: Path) -> Path:
    return page.with_name(page.name.removesuffix(".md") + ".ko.md")


def _split(text: str) -> tuple[list[tuple[str, str]], str]:
    """The fenced blocks (info, body) and the text outside them."""
    blocks = [(m["info"].strip(), m["body"]) for m in FENCE.finditer(text)]
    return blocks, FENCE.sub("", text)


def _headings(prose: str) -> list[tuple[int, str]]:
    out = []
    for level, title in HEADING.findall(prose):
        explicit = EXPLICIT_ID.search(title)
        out.append((len(level), explicit[1] if explicit else slugify(title, "-")))
    return out


def _numbers(prose: str) -> set[str]:
    # Link targets hold file names (03-paging.md), not numbers a reader reads.
    return set(NUMBER.findall(LINK_TARGET.sub("]()", prose)))


def _minus(a: list[str], b: list[str]) -> list[str]:
    return list((Counter(a) - Counter(b)).elements())


def test_the_site_has_pages():
    assert len(ENGLISH) >= 20, ENGLISH


@pytest.mark.parametrize("page", ENGLISH, ids=lambda p: p.relative_to(LESSONS).as_posix())
def test_korean_twin(page: Path):
    twin = _twin(page)
    name = page.relative_to(LESSONS).as_posix()
    assert twin.is_file(), f"{name} has no Korean twin: write {twin.relative_to(LESSONS)}"
    en_blocks, en_prose = _split(page.read_text())
    ko_blocks, ko_prose = _split(twin.read_text())

    def code(blocks):
        return [b for b in blocks if b[0] != "mermaid"]

    def diagrams(blocks):
        return [b for b in blocks if b[0] == "mermaid"]

    assert code(ko_blocks) == code(en_blocks), \
        f"{name}: the Korean twin's code blocks differ from the English ones (code stays identical)"
    assert len(diagrams(ko_blocks)) == len(diagrams(en_blocks)), f"{name}: mermaid diagram count"
    assert SNIPPET.findall(ko_prose) == SNIPPET.findall(en_prose), \
        f"{name}: the embedded snippets (--8<-- lines) differ"
    assert [i.replace(".ko.png", ".png") for i in IMAGE.findall(ko_prose)] == IMAGE.findall(
        en_prose), f"{name}: the figures differ (the Korean page embeds NAME.ko.png)"
    assert _headings(ko_prose) == _headings(en_prose), \
        (f"{name}: headings differ in number, level or anchor (give each Korean heading the "
         f"English slug: {{ #slug }}): en {_headings(en_prose)} ko {_headings(ko_prose)}")
    en_inline = sorted(" ".join(m[1].split()) for m in INLINE_CODE.findall(en_prose))
    ko_inline = sorted(" ".join(m[1].split()) for m in INLINE_CODE.findall(ko_prose))
    assert ko_inline == en_inline, (
        f"{name}: inline code differs: only in English {_minus(en_inline, ko_inline)}, "
        f"only in Korean {_minus(ko_inline, en_inline)}")
    assert len(ADMONITION.findall(ko_prose)) == len(ADMONITION.findall(en_prose)), \
        f"{name}: admonition count"
    assert len(MATH.findall(ko_prose)) == len(MATH.findall(en_prose)), f"{name}: formula count"
    missing = _numbers(en_prose) - _numbers(ko_prose)
    assert not missing, f"{name}: numbers of the English prose missing in Korean: {sorted(missing)}"


def test_no_orphan_twins():
    orphans = [p for p in LESSONS.rglob("*.ko.md")
               if not p.with_name(p.name.removesuffix(".ko.md") + ".md").is_file()]
    assert not orphans, f"Korean pages without an English page: {orphans}"

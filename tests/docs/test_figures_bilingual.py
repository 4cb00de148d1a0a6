"""Every figure comes in both languages, and each edition of a page embeds its own.

The figure scripts (lessons/figures/*.py) draw each figure twice through figlang.py: NAME.png in
English and NAME.ko.png in Korean (mkdocs-static-i18n's suffix layout: the Korean edition of the
site serves NAME.ko.png). Checked here, without drawing anything:

* every figure an English page embeds (``figures/NAME.png``) has its Korean edition on disk,
  and the page's Korean twin embeds ``figures/NAME.ko.png`` at the same place instead;
* no page embeds a figure that is not there, and no Korean edition is left without its English one;
* every script that draws a figure draws it through figlang (``draw_both``), and the Korean side
  of its text pairs (``T(english, korean)``) is Korean: it has Hangul wherever the English side
  has words.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = ROOT / "lessons"
FIGURES = LESSONS / "figures"
IMAGE = re.compile(r"!\[[^\]]*\]\((figures/[^)\s]+)\)")
HANGUL = re.compile(r"[\uac00-\ud7a3]")
WORD = re.compile(r"[A-Za-z]{3,}")

ENGLISH = sorted(p for p in LESSONS.glob("*.md") if not p.name.endswith(".ko.md"))
EMBEDDED = [(page, img) for page in ENGLISH for img in IMAGE.findall(page.read_text())]
# The scripts that write a figure: every one but the shared module and the table-only script.
SCRIPTS = sorted(p for p in FIGURES.glob("*.py")
                 if p.name != "figlang.py" and "savefig" in p.read_text())


def _korean(image: str) -> str:
    stem, _, ext = image.rpartition(".")
    return f"{stem}.ko.{ext}"


def test_there_are_figures():
    assert len(EMBEDDED) >= 20, EMBEDDED
    assert len(SCRIPTS) >= 20, SCRIPTS


@pytest.mark.parametrize("page,image", EMBEDDED,
                         ids=[f"{p.stem}:{Path(i).name}" for p, i in EMBEDDED])
def test_korean_page_embeds_the_korean_figure(page: Path, image: str):
    assert not image.endswith(".ko.png"), f"{page.name} embeds a Korean figure: {image}"
    assert (LESSONS / image).is_file(), f"{page.name}: {image} does not exist"
    korean = _korean(image)
    assert (LESSONS / korean).is_file(), \
        f"{image} has no Korean edition: run its script (lessons/figures/*.py) to draw {korean}"
    twin = page.with_name(page.name.removesuffix(".md") + ".ko.md")
    ko_images = IMAGE.findall(twin.read_text())
    en_images = IMAGE.findall(page.read_text())
    assert korean in ko_images, f"{twin.name} should embed {korean} where {page.name} has {image}"
    assert image not in ko_images, f"{twin.name} still embeds the English {image}"
    assert [i.replace(".ko.", ".") for i in ko_images] == en_images, \
        f"{twin.name}: the figures differ from {page.name}'s, or are in another order"


def test_every_korean_figure_has_its_english_one():
    orphans = [p.name for p in FIGURES.glob("*.ko.png")
               if not p.with_name(p.name.replace(".ko.png", ".png")).is_file()]
    assert not orphans, orphans


def _choosers(tree: ast.AST) -> set[str]:
    """The names bound to figlang.chooser(...) (T, or tr where T means something else)."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "chooser"):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _text(node: ast.AST) -> str:
    """The literal characters of a string expression (f-string holes and names left out)."""
    return " ".join(n.value for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_script_draws_both_editions(script: Path):
    source = script.read_text()
    assert "figlang.draw_both(" in source, f"{script.name} does not draw through figlang"
    tree = ast.parse(source)
    choosers = _choosers(tree)
    assert choosers, f"{script.name} never asks figlang.chooser(lang) for its words"
    pairs = [node.args for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in choosers and len(node.args) == 2]
    assert len(pairs) >= 3, f"{script.name}: only {len(pairs)} text pairs"
    literal = ast.Constant | ast.JoinedStr | ast.BinOp  # a string written here, maybe joined
    for en, ko in pairs:
        en_text, ko_text = _text(en), _text(ko)
        # Only where the English side has words and the Korean one is written out here (not
        # looked up in a table, which the check below covers).
        if WORD.search(en_text) and isinstance(ko, literal):
            assert HANGUL.search(ko_text), \
                f"{script.name}: the Korean text of {en_text[:60]!r} has no Hangul: {ko_text!r}"
    for node in ast.walk(tree):  # the Korean tables (STATES_KO, chunk_ko, ...): all Korean
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id.lower().endswith("ko")
                        for t in node.targets)):
            for value in node.value.values:
                assert HANGUL.search(_text(value)), \
                    f"{script.name}: a Korean table holds {_text(value)!r}"

"""No line of code a lesson page shows is wider than 88 columns.

A wider line makes its code block scroll sideways, so the end of the line is hidden on an
ordinary laptop screen (issue 25). The lines measured are the ones the page shows: every fenced
code block written in the page, and every ``--8<-- "path:section"`` include resolved the way
pymdownx.snippets does with mkdocs.yml's settings (paths relative to the repository root, the
section's nested markers dropped, the section dedented because ``dedent_subsections: true``).
A fence indented under a tab or an admonition has its indentation taken off, as the page does.
Mermaid fences are drawn as diagrams, not shown as code, so they are not measured.
"""

import re
import textwrap
import unicodedata
from pathlib import Path

import markdown
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MAX_COLUMNS = 88

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>.*)$")
INCLUDE = re.compile(r'^(?P<indent>[ \t]*)--8<--[ \t]+"(?P<target>[^"]+)"[ \t]*$')
SECTION_MARKER = re.compile(r"--8<-- \[(?P<kind>start|end):(?P<name>[-_0-9A-Za-z]+)\]")
LINE_RANGES = re.compile(r"^(?P<path>.+?)(?P<ranges>(?::\d*){1,2}(?:,\d*(?::\d*)?)*)$")


def lesson_pages(root: Path = ROOT) -> list[Path]:
    """The lesson pages: lessons/*.md, and lessons/build/*.md where that folder exists."""
    return sorted((root / "lessons").glob("*.md")) + sorted((root / "lessons/build").glob("*.md"))


def columns(line: str) -> int:
    """How many columns a line takes on screen: a wide (CJK) character takes two."""
    width = 0
    for char in line.expandtabs(4):
        if unicodedata.combining(char):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


def resolve_include(target: str, root: Path = ROOT) -> tuple[Path, list[tuple[int, str]]]:
    """The (1-based line in the file, text) pairs an include shows, dedented as the page shows.

    ``target`` is what sits between the quotes: ``path``, ``path:section`` or ``path:1:5,8:9``.
    """
    m = LINE_RANGES.match(target)
    if m and (root / m.group("path")).is_file():
        path = root / m.group("path")
        lines = path.read_text().split("\n")
        picked = []
        for span in m.group("ranges")[1:].split(","):
            start, _, end = span.partition(":")
            first = max(int(start) - 1, 0) if start else 0
            last = int(end) if end else len(lines)
            picked += [(n + 1, lines[n]) for n in range(first, min(last, len(lines)))]
        return path, _dedent(picked)
    file, _, section = target.partition(":")
    path = root / file
    if not path.is_file():
        raise FileNotFoundError(f"include {target!r}: {path} does not exist")
    lines = path.read_text().split("\n")
    if not section:
        return path, list(enumerate(lines, start=1))
    picked, inside, found = [], False, False
    for n, line in enumerate(lines, start=1):
        marker = SECTION_MARKER.search(line)
        if marker and marker.group("name") == section:
            if marker.group("kind") == "end":
                break  # the section's end, or an end before any start: pymdownx stops too
            inside = found = True
            continue
        if inside and not marker:  # another section's marker inside this one is not shown
            picked.append((n, line))
    if not found:
        raise ValueError(f"include {target!r}: {file} has no [start:{section}] marker")
    return path, _dedent(picked)


def _dedent(numbered: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """textwrap.dedent over the joined lines, as pymdownx.snippets does; line numbers kept."""
    texts = textwrap.dedent("\n".join(text for _, text in numbered)).split("\n")
    return [(n, text) for (n, _), text in zip(numbered, texts, strict=True)]


def shown_code_lines(page: Path, root: Path = ROOT) -> list[tuple[Path, int, str]]:
    """(source file, 1-based line, text as shown) for every code line the page shows."""
    shown = []
    fence = None  # (indent, fence characters, info string) of the open fence
    for n, line in enumerate(page.read_text().split("\n"), start=1):
        opening = FENCE.match(line)
        if fence is None:
            if opening:
                fence = (len(opening.group("indent").expandtabs(4)), opening.group("fence"),
                         opening.group("info").strip())
                continue
        elif (opening and opening.group("fence")[0] == fence[1][0]
              and len(opening.group("fence")) >= len(fence[1]) and not opening.group("info")):
            fence = None
            continue
        include = INCLUDE.match(line)
        if include:
            # The include's own indentation is kept; the fence's indentation is taken off.
            indent = len(include.group("indent").expandtabs(4)) - (fence[0] if fence else 0)
            path, lines = resolve_include(include.group("target"), root)
            shown += [(path, i, " " * max(indent, 0) + text) for i, text in lines]
        elif fence is not None and not fence[2].startswith("mermaid"):
            text = line.expandtabs(4)
            strip = min(fence[0], len(text) - len(text.lstrip(" ")))
            shown.append((page, n, text[strip:]))
    return shown


def too_wide(page: Path, root: Path = ROOT) -> list[str]:
    """'page: file:line: N columns' for every shown code line wider than MAX_COLUMNS."""
    return [f"{page.name}: {path.relative_to(root)}:{n}: {columns(text)} columns"
            for path, n, text in shown_code_lines(page, root) if columns(text) > MAX_COLUMNS]


def test_lessons_show_code():
    pages = lesson_pages()
    assert pages, "no lesson page found under lessons/: the folder or the pattern is wrong"
    assert sum(len(shown_code_lines(page)) for page in pages) > 1000, (
        "fewer than 1000 code lines found in the lessons: the fence or include parsing is broken")


def _snippets_config() -> dict:
    """pymdownx.snippets' settings from mkdocs.yml (its python tags are read as nothing)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    for extension in config["markdown_extensions"]:
        if isinstance(extension, dict) and "pymdownx.snippets" in extension:
            return extension["pymdownx.snippets"]
    raise AssertionError("mkdocs.yml does not configure pymdownx.snippets")


def test_includes_resolve_as_pymdownx_does():
    """resolve_include shows the very lines the site build shows, so the widths are the page's."""
    config = _snippets_config()
    assert config.get("dedent_subsections") is True, (
        "mkdocs.yml no longer dedents sections: widths here are measured after dedent")
    config["base_path"] = [str(ROOT / base) for base in config.get("base_path", ["."])]
    md = markdown.Markdown(extensions=["pymdownx.snippets"],
                           extension_configs={"pymdownx.snippets": config})
    snippets = md.preprocessors["snippet"]
    checked = 0
    for page in lesson_pages():
        for line in page.read_text().split("\n"):
            include = INCLUDE.match(line)
            if include:
                target = include.group("target")
                _, lines = resolve_include(target)
                expected = snippets.run([f'--8<-- "{target}"'])
                assert [text for _, text in lines] == expected, (
                    f"{page.name}: {target}: resolved differently from pymdownx.snippets")
                checked += 1
    assert checked, "no include found in the lessons"


@pytest.mark.parametrize("page", lesson_pages(), ids=lambda page: page.name)
def test_shown_code_fits(page):
    wide = too_wide(page)
    assert not wide, (f"code lines wider than {MAX_COLUMNS} columns (wrap them; for an include, "
                      "wrap the module's lines inside the section):\n" + "\n".join(wide))


def test_a_wide_line_fails(tmp_path):
    """A synthetic page: a wide page-local line and a wide included line are both caught."""
    (tmp_path / "lessons").mkdir()
    module = tmp_path / "mod.py"
    module.write_text("x = 1\n"
                      "def f():\n"
                      "    # --8<-- [start:body]\n"
                      f"    y = '{'a' * 82}'\n"        # 92 columns in the file, 88 once dedented
                      f"    z = '{'b' * 83}'\n"        # 89 once dedented: too wide
                      "    # --8<-- [end:body]\n")
    page = tmp_path / "lessons" / "page.md"
    page.write_text("Text " + "w" * 200 + "\n\n"         # prose is not code
                    "```python\n"
                    + "c" * 88 + "\n"                  # exactly the limit
                    + "d" * 89 + "\n"                  # page line 5: too wide
                    "```\n\n"
                    "=== \"Tab\"\n\n"
                    "    ```python\n"
                    "    " + "e" * 88 + "\n"           # indented under the tab: 88 shown
                    "    --8<-- \"mod.py:body\"\n"
                    "    ```\n\n"
                    "```mermaid\n"
                    + "f" * 120 + "\n"                 # a diagram, not code
                    "```\n")
    assert lesson_pages(tmp_path) == [page]
    assert too_wide(page, tmp_path) == ["page.md: lessons/page.md:5: 89 columns",
                                        "page.md: mod.py:5: 89 columns"]


def test_columns_counts_wide_characters():
    assert columns("abc") == 3
    assert columns("한글") == 4
    assert columns("\tx") == 5

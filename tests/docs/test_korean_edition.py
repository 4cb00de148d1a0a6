"""The course as a Korean reader meets it, checked in the sources (issue 42).

* **No italic Hangul.** Hangul has no italic form; a browser slants it, and Korean typography
  emphasises with bold or quotes. No Korean page wraps Hangul in markdown emphasis
  (``*...*``, ``_..._``); code, snippets and formulas are not prose and are left alone.
  (The site's CSS also sets every ``em`` of a Korean page upright, for whatever slips through;
  test_site_browser.py checks the computed style.)
* **Source articles, not seeds.** The course grew from five Korean articles. They are "source
  article 3" / "원문 글 3"; "seed" / "시드" is only a request's random seed (``--seed 42``). A
  page that mentions them links to ``sources.md``, which has a section for every article a page
  cites, in both editions, and is in the navigation of both.
* **The language switch is relative**, so it works under a sub-path and from disk: in
  ``mkdocs.yml`` and on every built page.
* **The Korean style sheet** is listed in ``mkdocs.yml`` and holds the Korean rules (line
  breaking between words, the Korean font stack, upright emphasis).
"""

import re
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LESSONS = ROOT / "lessons"
KOREAN = sorted(LESSONS.rglob("*.ko.md"))
ENGLISH = sorted(p for p in LESSONS.rglob("*.md") if not p.name.endswith(".ko.md"))

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[^\n]*\n.*?^(?P=indent)(?P=fence)[ \t]*$", re.S | re.M)
SNIPPET = re.compile(r"^[ \t]*--8<--.*$", re.M)
INLINE_CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
MATH = re.compile(r"\$\$.*?\$\$|\\\(.*?\\\)|\\\[.*?\\\]|\$[^$\n]+\$", re.S)
HANGUL = re.compile(r"[\uac00-\ud7a3\u3131-\u318e]")
# Markdown emphasis: one * (not part of **; python-markdown takes it inside a word too), or one _
# at word boundaries; a span may continue over a line break but not over a blank line.
EMPHASIS = re.compile(
    r"(?<![*\\])\*(?![*\s])((?:[^*\n]|\n(?![ \t]*\n))+?)(?<![\s*\\])\*(?!\*)"
    r"|(?<![\w\\])_(?![_\s])((?:[^_\n]|\n(?![ \t]*\n))+?)(?<![\s_\\])_(?!\w)")
SEED_KO = re.compile(r"시드\s+0\d\d|시드\s+글")
SEED_EN = re.compile(r"\b[Ss]eeds?\s+0\d\d\b|\b[Ss]eed\s+articles?\b")
CITED = re.compile(r"(?:[Ss]ource\s+article|원문\s+글)\s+(\d)(?!\d)")
MENTION = re.compile(r"[Ss]ource\s+articles?\b|원문\s+글")


def _name(page: Path) -> str:
    return page.relative_to(LESSONS).as_posix()


def _prose(text: str) -> str:
    """The text with code blocks, snippet lines, inline code and formulas blanked out (line
    breaks kept, so that positions still give line numbers)."""
    def blank(m):
        return re.sub(r"[^\n]", "\0", m[0])
    for pattern in (FENCE, SNIPPET, INLINE_CODE, MATH):
        text = pattern.sub(blank, text)
    return text


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@pytest.mark.parametrize("page", KOREAN, ids=_name)
def test_no_italic_hangul(page: Path):
    prose = _prose(page.read_text())
    italic = [f"line {_line(prose, m.start())}: {m[0]!r}" for m in EMPHASIS.finditer(prose)
              if HANGUL.search(m[1] or m[2])]
    assert not italic, (f"{_name(page)}: Hangul in markdown emphasis renders slanted; write "
                        f"**bold** or quotes instead: {italic}")


@pytest.mark.parametrize("page", KOREAN + ENGLISH, ids=_name)
def test_source_articles_are_not_called_seeds(page: Path):
    prose = _prose(page.read_text())
    pattern = SEED_KO if page.name.endswith(".ko.md") else SEED_EN
    found = [f"line {_line(prose, m.start())}: {m[0]!r}" for m in pattern.finditer(prose)]
    assert not found, (f"{_name(page)}: the articles the course grew from are 'source article N' "
                       f"/ '원문 글 N' (sources.md); 'seed' is a random seed only: {found}")


def _anchors(page: Path) -> set[str]:
    return set(re.findall(r"\{[^}]*#([\w-]+)[^}]*\}\s*$", page.read_text(), re.M))


def test_sources_page_in_both_editions():
    english, korean = LESSONS / "sources.md", LESSONS / "sources.ko.md"
    assert english.is_file() and korean.is_file()
    for page in (english, korean):
        text = page.read_text()
        # The articles are described, not shipped: no path to a copy a reader does not have.
        assert "shared/" not in text and "seeds/" not in text, page
    cited = {m[1] for page in KOREAN + ENGLISH for m in CITED.finditer(_prose(page.read_text()))}
    assert cited, "no page cites a source article by number"
    for page in (english, korean):
        missing = {f"source-article-{n}" for n in cited} - _anchors(page)
        assert not missing, f"{_name(page)} has no section for {sorted(missing)}"


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):
        pass
    # mkdocs.yml names Python objects (!!python/name:...); their values do not matter here.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def _nav_pages(nav) -> list[tuple[str, str]]:
    out = []
    for item in nav:
        if isinstance(item, str):
            out.append(("", item))
        else:
            for title, value in item.items():
                out += _nav_pages(value) if isinstance(value, list) else [(title, value)]
    return out


def test_sources_page_in_the_navigation():
    config = _mkdocs_config()
    titles = {page: title for title, page in _nav_pages(config["nav"])}
    assert "sources.md" in titles, "sources.md is not in mkdocs.yml's nav"
    i18n = next(p["i18n"] for p in config["plugins"] if isinstance(p, dict) and "i18n" in p)
    korean = next(lang for lang in i18n["languages"] if lang["locale"] == "ko")
    assert titles["sources.md"] in korean["nav_translations"], \
        "the sources page has no Korean title in nav_translations"


@pytest.mark.parametrize("page", KOREAN + ENGLISH, ids=_name)
def test_a_page_that_mentions_the_articles_links_to_them(page: Path):
    if page.name.startswith("sources."):
        return
    text = page.read_text()
    if MENTION.search(_prose(text)):
        assert re.search(r"\]\((?:\.\./)*sources\.md(?:#[\w-]+)?\)", text), \
            f"{_name(page)} mentions the source articles but does not link to sources.md"


def test_korean_style_sheet():
    config = _mkdocs_config()
    sheets = config.get("extra_css", [])
    assert sheets, "mkdocs.yml lists no extra_css"
    css = "\n".join((LESSONS / s).read_text() for s in sheets)
    for rule in ("word-break: keep-all", "Apple SD Gothic Neo", "Malgun Gothic", "Noto Sans KR",
                 "Nanum Gothic", "font-style: normal"):
        assert rule in css, f"the site's CSS lacks {rule!r}"
    assert 'lang="ko"' in css or ":lang(ko)" in css


def test_language_switch_links_are_relative_in_the_config():
    config = _mkdocs_config()
    links = [alt["link"] for alt in config["extra"]["alternate"]]
    assert links, "mkdocs.yml sets no extra.alternate"
    for link in links:
        parts = urlsplit(link)
        assert not parts.scheme and not parts.netloc and not link.startswith("/"), \
            f"extra.alternate link {link!r} is absolute: it breaks under a sub-path or from disk"


def test_language_switch_links_are_relative_on_every_page(built_site: Path):
    switch = re.compile(r'<a href="([^"]*)" hreflang="([^"]*)" class="md-select__link"')
    checked = 0
    for html in sorted(built_site.rglob("*.html")):
        page = html.relative_to(built_site).as_posix()
        if page.endswith("404.html"):
            continue  # served at any missing URL, so no relative link can be right there
        links = switch.findall(html.read_text())
        assert {lang for _, lang in links} == {"en", "ko"}, f"{page}: language switch {links}"
        for href, lang in links:
            assert not urlsplit(href).scheme and not href.startswith("/"), \
                f"{page}: the language switch links to {href!r}, an absolute address"
            # It leads to a page of that language that exists.
            target = urlsplit(urljoin("http://site/" + page, href)).path.lstrip("/")
            target_file = built_site / (target + "index.html" if target.endswith("/") or not
                                        target else target)
            assert target_file.is_file(), f"{page}: switch to {lang} leads to missing {target}"
            assert target.startswith("ko/") == (lang == "ko"), f"{page}: {href} for {lang}"
            checked += 1
    assert checked >= 40, checked

"""Every figure in two editions: English (NAME.png) and Korean (NAME.ko.png).

Each figure script draws its figure with one function that takes the language; the words on
the figure (titles, axis labels, legends, annotations) come as pairs, English first, through
the chooser this module gives it:

    T = figlang.chooser(lang)
    ax.set_title(T("Blocks in use", "사용 중인 블록"))

and ``figlang.draw_both(draw, path, ...)`` calls ``draw(..., path=..., lang=...)`` once per
edition, the Korean one with a font that has Hangul. Numbers, code names (``block_size``) and
the data are the same in both editions; only the words change.

The Korean font is NanumGothic, shipped as a file inside the ``koreanize-matplotlib`` wheel (a
dev dependency); the package is never imported (its import changes matplotlib's global settings
and needs distutils): only its font files are read, so the figures build offline.
tests/docs/test_figures_bilingual.py checks that every figure a page embeds has its Korean
edition, embedded by the Korean page.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

LANGS = ("en", "ko")
KOREAN_FONT = "NanumGothic"
# matplotlib's own font first: the Latin letters, digits and symbols look as in the English
# edition, and mathtext's tick labels (10⁻², with U+2212, which NanumGothic lacks) keep their
# glyphs; a Hangul syllable, absent from DejaVu Sans, falls back to NanumGothic, glyph by glyph.
LATIN_FONT = "DejaVu Sans"


def edition(path: Path, lang: str) -> Path:
    """NAME.png for English, NAME.ko.png for Korean (mkdocs-static-i18n's suffix layout)."""
    path = Path(path)
    return path if lang == "en" else path.with_name(f"{path.stem}.{lang}{path.suffix}")


def chooser(lang: str) -> Callable[[str, str], str]:
    """T(english, korean) -> the text of this edition."""
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; one of {LANGS}")
    return (lambda en, ko: ko) if lang == "ko" else (lambda en, ko: en)


def korean_font_files() -> list[Path]:
    """NanumGothic's .ttf files from the koreanize-matplotlib wheel, found without importing it."""
    spec = importlib.util.find_spec("koreanize_matplotlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Korean figures need a Hangul font: pip install "
                           "koreanize-matplotlib (a dev dependency; it ships NanumGothic)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "fonts"
    files = sorted(folder.glob("NanumGothic*.ttf"))
    if not files:
        raise RuntimeError(f"no NanumGothic*.ttf in {folder}")
    return files


@contextlib.contextmanager
def language(lang: str) -> Iterator[Callable[[str, str], str]]:
    """matplotlib's settings for one edition (the Korean font for "ko"), restored after."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import font_manager

    with matplotlib.rc_context():
        if lang == "ko":
            known = {f.name for f in font_manager.fontManager.ttflist}
            if KOREAN_FONT not in known:
                for file in korean_font_files():
                    font_manager.fontManager.addfont(str(file))
            matplotlib.rcParams["font.family"] = [LATIN_FONT, KOREAN_FONT]
        yield chooser(lang)


def draw_both(draw: Callable[..., None], path: Path, *args, **kwargs) -> list[Path]:
    """draw(*args, path=NAME[.ko].png, lang=..., **kwargs) for each edition; the paths."""
    written = []
    for lang in LANGS:
        out = edition(path, lang)
        with language(lang):
            draw(*args, path=out, lang=lang, **kwargs)
        written.append(out)
    return written

"""The lessons site as a reader's browser shows it, offline.

Builds the site into a temporary folder, serves it on 127.0.0.1 and opens every page in headless
Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by selenium). On every page:

* no JavaScript error (no SEVERE entry in the browser's console log, no failed load);
* every formula typeset: each arithmatex span holds a MathJax container, no MathJax error, no
  raw ``\\(``, ``\\[`` or ``$$`` left in the text, and no literal backslash in the typeset math
  (``\\text{block\\_size}`` shows one);
* every mermaid diagram drawn (an ``<svg>`` inside each ``div.mermaid``), in the light and in the
  dark palette, with every node's label readable on its fill (contrast of at least 4.5:1);
* every image loaded (``naturalWidth > 0``);
* nothing runs off the page: the document is no wider than the window (a wide table or code
  block scrolls inside its own box);
* no request leaves 127.0.0.1: the host resolver maps every other name to nothing, and every
  request the page makes (the DevTools ``Network.requestWillBeSent`` events of the performance
  log) is checked.

On a few Korean pages, in a window 400 px wide (a phone), what a Korean reader needs: lines
break between words, never inside one (``word-break: keep-all``; Chromium otherwise breaks Hangul
between any two syllables), no Hangul is slanted (Hangul has no italic), and the text is set in
the Korean font stack. Two Korean pages load the Korean edition of each figure (the bytes of
``lessons/figures/NAME.ko.png``, served as ``ko/figures/NAME.png``). Lesson 17's seven-column
tables fit a 1280-px window. The page that describes the source articles exists in both
editions, and the language switch, relative on every page, leads from each home page to the
other.

Skips where Chromium, its driver or selenium is absent; ``.ci/run`` installs Chromium first so
that CI always runs it.
"""

import functools
import http.server
import json
import shutil
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if
                 p and Path(p).is_file()), None)
CHROMEDRIVER = next((p for p in ("/usr/bin/chromedriver", shutil.which("chromedriver") or "")
                     if p and Path(p).is_file()), None)

if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("Chromium and its driver are absent (apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver",
                                reason="selenium is absent (pip install -e '.[dev]')")

LOCAL_SCHEMES = {"data", "blob", "about"}
MIN_CONTRAST = 4.5  # WCAG AA for normal text

# Waits for MathJax's startup, every mermaid diagram (in the palette given) and every image, then
# reports what the page shows. Runs as an async script: the last argument is the callback.
INSPECT = r"""
const done = arguments[arguments.length - 1];
const theme = arguments[0];
const deadline = Date.now() + 20000;
function until(test) {
  return new Promise((resolve) => {
    (function poll() {
      if (test() || Date.now() > deadline) resolve();
      else setTimeout(poll, 50);
    })();
  });
}
const diagrams = () => [...document.querySelectorAll("div.mermaid")];
const mathjax = window.MathJax && window.MathJax.startup && window.MathJax.startup.promise;
Promise.all([
  mathjax ? mathjax.catch(() => null) : Promise.resolve(),
  until(() => diagrams().every((d) => d.dataset.theme === theme && d.querySelector("svg"))),
  until(() => [...document.images].every((img) => img.complete)),
]).then(() => {
  const rgb = (css) => {
    const m = css && css.match(/rgba?\(([\d.]+),\s*([\d.]+),\s*([\d.]+)(?:,\s*([\d.]+))?/);
    return m && (m[4] === undefined || +m[4] > 0) ? [+m[1], +m[2], +m[3]] : null;
  };
  const luminance = (c) => {
    const [r, g, b] = c.map((v) => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const contrast = (a, b) => {
    const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
    return (hi + 0.05) / (lo + 0.05);
  };
  const lowContrast = [];
  for (const node of document.querySelectorAll("div.mermaid g.node")) {
    const shape = node.querySelector("rect, polygon, path, circle, ellipse");
    const label = node.querySelector(".nodeLabel") || node.querySelector("text");
    if (!shape || !label) continue;
    const fill = rgb(getComputedStyle(shape).fill);
    const ink = label.namespaceURI === "http://www.w3.org/2000/svg"
      ? rgb(getComputedStyle(label).fill) : rgb(getComputedStyle(label).color);
    if (!fill || !ink) continue;
    const ratio = contrast(fill, ink);
    if (ratio < %(min_contrast)s) {
      lowContrast.push(`${label.textContent.trim()} (${ratio.toFixed(2)}:1)`);
    }
  }
  const article = document.querySelector("article") || document.body;
  const prose = article.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style, mjx-container").forEach((e) => e.remove());
  const text = prose.textContent;
  done({
    arithmatex: document.querySelectorAll(".arithmatex").length,
    untypeset: [...document.querySelectorAll(".arithmatex")]
      .filter((e) => !e.querySelector("mjx-container")).map((e) => e.textContent.slice(0, 80)),
    mathErrors: [...document.querySelectorAll("mjx-merror, [data-mjx-error]")]
      .map((e) => e.getAttribute("data-mjx-error") || e.textContent.slice(0, 80)),
    backslashMath: [...document.querySelectorAll("mjx-assistive-mml")]
      .map((e) => e.textContent).filter((t) => t.includes("\\")).map((t) => t.slice(0, 80)),
    rawTex: ["\\(", "\\[", "$$"].filter((s) => text.includes(s)),
    diagrams: diagrams().length,
    undrawn: diagrams().filter((d) => !d.querySelector("svg"))
      .map((d) => (d.dataset.source || d.textContent).slice(0, 60)),
    lowContrast: lowContrast,
    overflow: document.documentElement.scrollWidth - window.innerWidth,
    images: document.images.length,
    brokenImages: [...document.images]
      .filter((i) => !i.complete || i.naturalWidth === 0).map((i) => i.src),
  });
});
""".replace("%(min_contrast)s", str(MIN_CONTRAST))


@pytest.fixture(scope="module")
def site(built_site):
    return built_site  # conftest.py: built once for every docs test that needs the site


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps",
                "--disable-extensions", "--mute-audio",
                # Every name but 127.0.0.1 resolves to nothing: a request that would leave the
                # machine fails (and shows in the logs below) instead of reaching the network.
                '--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1'):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(40)
    yield driver
    driver.quit()


def _pages(site: Path) -> list[str]:
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    return [p.removesuffix("index.html") for p in pages]


def _requests(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def _external(urls: list[str], origin: str) -> list[str]:
    return [u for u in urls
            if urlsplit(u).scheme not in LOCAL_SCHEMES and not u.startswith(origin + "/")]


def test_every_page_offline(site, server, browser):
    pages = _pages(site)
    assert "" in pages and len(pages) >= 10, f"the site has too few pages: {pages}"
    problems = []
    totals = {"arithmatex": 0, "diagrams": 0, "images": 0}
    for page in pages:
        url = f"{server}/{page}"
        browser.get(url)
        seen = [browser.execute_async_script(INSPECT, "default")]
        if seen[0]["diagrams"]:  # the dark palette redraws the diagrams in mermaid's dark theme
            browser.execute_script(
                "document.body.setAttribute('data-md-color-scheme', 'slate')")
            seen.append(browser.execute_async_script(INSPECT, "dark"))
        requests = _requests(browser)
        errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]

        where = page or "index"
        if errors:
            problems.append(f"{where}: JavaScript errors or failed loads: {errors}")
        outside = _external(requests, server)
        if outside:
            problems.append(f"{where}: requests leave 127.0.0.1: {outside}")
        first = seen[0]
        if first["untypeset"]:
            problems.append(f"{where}: formulas left as TeX: {first['untypeset']}")
        if first["rawTex"]:
            problems.append(f"{where}: raw TeX delimiters {first['rawTex']} in the text")
        if first["mathErrors"]:
            problems.append(f"{where}: MathJax errors: {first['mathErrors']}")
        if first["backslashMath"]:
            problems.append(f"{where}: typeset formulas show a literal backslash (write "
                            f"\\text{{block_size}}, not \\text{{block\\_size}}): "
                            f"{first['backslashMath']}")
        for palette, result in zip(("light", "dark"), seen, strict=False):
            if result["undrawn"]:
                problems.append(f"{where}: mermaid diagrams not drawn ({palette}): "
                                f"{result['undrawn']}")
            if result["lowContrast"]:
                problems.append(f"{where}: diagram labels hard to read on their fill "
                                f"({palette} palette, below {MIN_CONTRAST}:1): "
                                f"{result['lowContrast']}")
        if first["overflow"] > 0:
            problems.append(f"{where}: the page is {first['overflow']} px wider than the window "
                            f"(something runs off its right edge)")
        if first["brokenImages"]:
            problems.append(f"{where}: images not loaded: {first['brokenImages']}")
        for key in totals:
            totals[key] += first[key]

    assert not problems, "\n".join(problems)
    # The checks saw something: the lessons have formulas, diagrams and figures.
    assert all(totals.values()), f"nothing of some kind was checked: {totals}"


def _search(browser, url: str, query: str) -> list[str]:
    """The result links material's search shows for `query` typed on the page at url."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    browser.execute_script("document.querySelector('label.md-search__icon, "
                           "label[for=__search]').click()")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.send_keys(query)
    WebDriverWait(browser, 20).until(lambda b: b.find_elements(
        By.CSS_SELECTOR, ".md-search-result__item a, .md-search-result__meta"))
    WebDriverWait(browser, 20).until(lambda b: b.find_elements(
        By.CSS_SELECTOR, ".md-search-result__item a") or "No matching" in b.find_element(
        By.CSS_SELECTOR, ".md-search-result__meta").text)
    return [a.get_attribute("href") for a in
            browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")]


@pytest.mark.parametrize("edition, query, expect", [
    ("", "preemption", ""),
    # lunr.ko trims and drops stop words but keeps a particle on its word (블록을); the
    # search matches a query term as a prefix, so 블록 finds 블록을, and 스케줄 finds
    # 스케줄러 and 스케줄링, which never occur bare.
    ("ko/", "블록", "ko/"),
    ("ko/", "스케줄", "ko/"),
])
def test_search_finds_pages_in_each_edition(server, browser, edition, query, expect):
    links = _search(browser, f"{server}/{edition}", query)
    ours = [u for u in links if u.startswith(f"{server}/{expect}")]
    assert ours, f"searching {query!r} on /{edition} found no page of that edition: {links}"
    if edition == "ko/":
        # The Korean edition's results are Korean pages.
        assert all(u.startswith(f"{server}/ko/") for u in links[:5]), links[:5]


def test_language_switch_leads_to_the_twin(server, browser):
    from selenium.webdriver.common.by import By

    for here, there, lang in (("ko/03-paging/", "03-paging/", "en"),
                              ("03-paging/", "ko/03-paging/", "ko"),
                              ("ko/", "", "en"), ("", "ko/", "ko")):
        browser.get(f"{server}/{here}")
        assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") != lang
        link = browser.find_element(By.CSS_SELECTOR, f"a.md-select__link[hreflang={lang}]")
        # Relative, so that the switch also works under a sub-path and from disk.
        written = browser.execute_script("return arguments[0].getAttribute('href')", link)
        assert not written.startswith("/") and "://" not in written, (here, written)
        browser.get(link.get_attribute("href"))
        assert browser.current_url == f"{server}/{there}", browser.current_url
        assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == lang


# Every <img> of a figure on a Korean page, once the browser has loaded it: its resolved src and
# its natural width.
FIGURES_SHOWN = """
const done = arguments[arguments.length - 1];
const figures = [...document.querySelectorAll("article img")]
  .filter((img) => new URL(img.src).pathname.includes("/figures/"));
Promise.all(figures.map((img) => img.decode().catch(() => null)))
  .then(() => done(figures.map((img) => [img.src, img.naturalWidth])));
"""


def test_korean_pages_show_the_korean_figures(server, browser):
    # The page writes figures/NAME.ko.png; mkdocs-static-i18n publishes that file as
    # ko/figures/NAME.png (and the English NAME.png as figures/NAME.png), so what the Korean
    # page's <img> loads must be under ko/figures/ and be the bytes of NAME.ko.png.
    from urllib.request import urlopen

    figures = ROOT / "lessons" / "figures"
    for page in ("ko/03-paging/", "ko/18-weight-quantization/"):
        browser.get(f"{server}/{page}")
        shown = browser.execute_async_script(FIGURES_SHOWN)
        assert shown, f"{page}: no figure on the page"
        for src, width in shown:
            path = urlsplit(src).path
            assert path.startswith("/ko/figures/") and path.endswith(".png"), (page, src)
            assert width > 0, f"{page}: {src} did not load"
            name = path.rsplit("/", 1)[1]
            with urlopen(src, timeout=10) as response:
                served = response.read()
            korean = (figures / name.replace(".png", ".ko.png")).read_bytes()
            assert served == korean, f"{page}: {src} is not lessons/figures/{name[:-4]}.ko.png"
            assert served != (figures / name).read_bytes(), f"{page}: {src} is the English figure"


# Run on a Korean page: every text node with Hangul outside code and formulas, its computed
# style, and each run of Hangul syllables (a word, or the part of one between two elements):
# broken over two lines, its range has rectangles on two lines.
KOREAN_TEXT = r"""
const hangul = /[\uac00-\ud7a3]/;
const runs = /[\uac00-\ud7a3]{2,}/g;
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
const range = document.createRange();
const italic = [], broken = [];
let words = 0;
for (let node; (node = walker.nextNode());) {
  const el = node.parentElement;
  if (!el || !hangul.test(node.data)) continue;
  // Not prose, or not shown: the search box's texts sit in a box of no width until it opens.
  if (el.closest("pre, code, script, style, noscript, mjx-container, svg, .md-search")) continue;
  const style = getComputedStyle(el);
  if (style.fontStyle !== "normal") italic.push(`${el.tagName}: ${node.data.trim().slice(0, 40)}`);
  for (const m of node.data.matchAll(runs)) {
    range.setStart(node, m.index);
    range.setEnd(node, m.index + m[0].length);
    const lines = new Set([...range.getClientRects()].filter((r) => r.width > 0)
      .map((r) => Math.round(r.bottom)));
    words += lines.size > 0;
    if (lines.size > 1) broken.push(`${m[0]} (${el.tagName}.${el.className})`);
  }
}
const style = (sel) => {
  const el = document.querySelector(sel);
  return el && getComputedStyle(el);
};
return {
  lang: document.documentElement.lang,
  italic: italic.slice(0, 10),
  broken: broken.slice(0, 10),
  words: words,
  wordBreak: ["article p", ".md-nav__link", "article th"].map((sel) => style(sel))
    .filter((s) => s).map((s) => s.wordBreak),
  fontFamily: style("article p").fontFamily,
  overflow: document.documentElement.scrollWidth - window.innerWidth,
};
"""
KOREAN_FONTS = ["Apple SD Gothic Neo", "Malgun Gothic", "Noto Sans KR", "Nanum Gothic"]


def test_korean_reads_as_korean_on_a_narrow_screen(server, browser):
    browser.set_window_size(400, 900)
    try:
        problems = []
        for page in ("ko/", "ko/03-paging/", "ko/17-kv-cache-quantization/", "ko/sources/"):
            browser.get(f"{server}/{page}")
            seen = browser.execute_script(KOREAN_TEXT)
            assert seen["lang"] == "ko", page
            assert seen["words"] > 100, f"{page}: too few Korean words laid out: {seen['words']}"
            if seen["broken"]:
                problems.append(f"{page}: Korean words broken over two lines: {seen['broken']}")
            if seen["italic"]:
                problems.append(f"{page}: slanted Hangul: {seen['italic']}")
            if set(seen["wordBreak"]) != {"keep-all"}:
                problems.append(f"{page}: word-break {seen['wordBreak']}, not keep-all")
            families = [f.strip().strip('"') for f in seen["fontFamily"].split(",")]
            if families[:len(KOREAN_FONTS)] != KOREAN_FONTS or families[-1] != "sans-serif":
                problems.append(f"{page}: font stack {families}")
            if seen["overflow"] > 0:
                problems.append(f"{page}: {seen['overflow']} px wider than a 400-px window")
        assert not problems, "\n".join(problems)
    finally:
        browser.set_window_size(1280, 900)


def test_lesson_17_tables_fit_and_sources_page_in_both_editions(server, browser):
    from selenium.webdriver.common.by import By

    for edition, title in (("", "The source articles"), ("ko/", "원문 글")):
        browser.get(f"{server}/{edition}17-kv-cache-quantization/")
        # Seven columns: each table fits the text column of a 1280-px window, no scrolling.
        wide = browser.execute_script("""
            return [...document.querySelectorAll("article table")].map((t) => {
              const box = t.closest(".md-typeset__scrollwrap") || t.parentElement;
              return box.scrollWidth - box.clientWidth;
            });""")
        assert wide and max(wide) <= 0, f"{edition}17: tables wider than the column: {wide}"
        browser.get(f"{server}/{edition}sources/")
        assert browser.find_element(By.TAG_NAME, "h1").text.strip().startswith(title)
        sections = browser.find_elements(By.CSS_SELECTOR, "article h2[id^=source-article-]")
        assert len(sections) == 5, [s.get_attribute("id") for s in sections]

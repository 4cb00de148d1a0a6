"""MkDocs hooks of the lessons site (mkdocs.yml: ``hooks``).

Material fetches ``sitemap.xml`` beside every ``<link rel="alternate" hreflang>`` of a page
head, to map pages between languages (mkdocs-material#6582). mkdocs-static-i18n points those
links at each page's twin (``/ko/01-kv-cache/``), so every page asked for
``/ko/01-kv-cache/sitemap.xml``, which does not exist: a failed request on every page. The
language switch itself is the header's ``<a hreflang>`` links, which already lead to the
page's twin, so the head links are dropped: nothing is fetched, the switch works as before
(tests/docs/test_site_browser.py checks both).
"""

import re

ALTERNATE = re.compile(r'<link rel="alternate" href="[^"]*" hreflang="[^"]*">\s*')


def on_post_page(output: str, page, config) -> str:  # every page
    return ALTERNATE.sub("", output)


def on_post_template(output: str, template_name: str, config) -> str:
    return ALTERNATE.sub("", output)  # 404.html, rendered as a template, not a page

// MathJax settings for pymdownx.arithmatex (generic mode): typeset only the math it marks.
// Loaded before the vendored javascripts/vendor/mathjax/tex-svg-full.js (SVG output: no font
// files; the full bundle holds every TeX extension, so nothing is fetched on demand).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
  svg: { fontCache: "global" },
};

// mkdocs-material emits document$ for the first page and, with instant navigation, for each
// page it swaps in without a reload. MathJax typesets the first page itself once its startup
// finishes; later pages are typeset here. Nothing is touched before MathJax has loaded (it is
// absent, or still the settings object above, until its script runs).
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    const mj = window.MathJax;
    if (!mj || !mj.startup || !mj.startup.promise) return;
    mj.startup.promise.then(() => {
      if (mj.startup.output && mj.startup.output.clearCache) mj.startup.output.clearCache();
      mj.typesetClear();
      mj.texReset();
      return mj.typesetPromise();
    });
  });
}

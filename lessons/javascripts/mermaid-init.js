// Draws every ```mermaid fence (pymdownx.superfences renders it as <div class="mermaid">) with
// the vendored javascripts/vendor/mermaid/mermaid.min.js: nothing is loaded from the network.
// mkdocs-material's own integration handles only <pre class="mermaid"> and fetches mermaid from
// a CDN when none is loaded, so the fence uses a <div> and this script does the drawing.
// The diagram is drawn in mermaid's light or dark theme to match the palette and redrawn when
// the reader toggles it.
(function () {
  if (typeof mermaid === "undefined") return;
  let drawn = 0;

  function scheme() {
    return document.body.getAttribute("data-md-color-scheme") === "slate" ? "dark" : "default";
  }

  async function draw() {
    const theme = scheme();
    mermaid.initialize({ startOnLoad: false, theme: theme, securityLevel: "strict" });
    for (const el of document.querySelectorAll("div.mermaid")) {
      if (!el.dataset.source) el.dataset.source = el.textContent;
      if (el.dataset.theme === theme) continue;
      const { svg } = await mermaid.render(`mermaid-svg-${drawn++}`, el.dataset.source);
      el.innerHTML = svg;
      el.dataset.theme = theme;
    }
  }

  // One drawing at a time: a palette toggle during a drawing waits for it.
  let queue = Promise.resolve();
  function redraw() {
    queue = queue.then(draw).catch((error) => console.error("mermaid:", error));
  }

  function start() {
    new MutationObserver(redraw).observe(document.body, {
      attributes: true,
      attributeFilter: ["data-md-color-scheme"],
    });
    if (typeof document$ !== "undefined") document$.subscribe(redraw);
    else redraw();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();

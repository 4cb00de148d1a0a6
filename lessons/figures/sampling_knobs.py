"""How each sampling knob reshapes one real next-token distribution (lesson 16's figure).

The shipped tiny model (tiny-pydoc) reads the prompt "Return the number of" and gives one row of
4,096 next-token logits. The script passes that row through the reference sampler's own code
(reference/ops/sampling.py: the temperature division, then ``_top_k_top_p``) under six settings:

- the raw distribution (temperature 1, nothing cut);
- temperature 0.5 and temperature 2.0;
- top_k = 5;
- top_p = 0.5;
- temperature 0.8 with top_p = 0.9 (a common chat setting).

For each it draws the probabilities of the 24 most likely raw tokens as bars, reports how many of
the 4,096 tokens keep a non-zero probability and the distribution's entropy, and checks the
exponential race: it runs the real ``sample`` on 4,000 rows that differ only in their random
stream (seeds 0 to 3,999) and overlays how often each token was drawn. The frequencies should
match the bars to within sampling noise (a few points of a percent at 4,000 draws).

It writes sampling_knobs.png, its Korean edition sampling_knobs.ko.png (figlang.py) and
sampling_knobs.json next to itself and prints a summary.

    .venv/bin/python lessons/figures/sampling_knobs.py     # a few seconds
    .venv/bin/python lessons/figures/sampling_knobs.py --plot-only   # redraw from the .json
"""

import argparse
import json
import math
from pathlib import Path

import figlang
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from pagedllm.reference import NoCache, load_model  # noqa: E402
from pagedllm.reference.ops.sampling import (  # noqa: E402
    SamplingMetadata,
    SamplingRow,
    _top_k_top_p,
    sample,
)
from pagedllm.serving.default_model import default_model_dir  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT = "Return the number of"
SHOWN = 24  # bars: the most likely raw tokens
DRAWS = 4000  # rows of the empirical check, one random stream each
KNOBS = [  # (title, temperature, top_k, top_p)
    ("raw: temperature 1", 1.0, -1, 1.0),
    ("temperature 0.5", 0.5, -1, 1.0),
    ("temperature 2.0", 2.0, -1, 1.0),
    ("top_k = 5", 1.0, 5, 1.0),
    ("top_p = 0.5", 1.0, -1, 0.5),
    ("temperature 0.8, top_p = 0.9", 0.8, -1, 0.9),
]


@torch.inference_mode()
def next_token_logits(path: Path, tokenizer) -> torch.Tensor:
    """The model's logits [vocab] for the token after PROMPT."""
    model = load_model(path)
    ids = tokenizer(PROMPT).input_ids
    last = torch.tensor([len(ids) - 1])
    return model(torch.tensor(ids), torch.arange(len(ids)), NoCache(), logits_indices=last)[0]


def distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """What the sampler draws from: the reference's own temperature division and cuts."""
    scaled = logits.float()[None] / temperature
    return _top_k_top_p(scaled, torch.tensor([top_k]), torch.tensor([top_p]))[0]  # [vocab]


def frequencies(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """How often the real sampler picks each token over DRAWS random streams."""
    vocab = logits.shape[-1]
    counts = torch.zeros(vocab, dtype=torch.int64)
    for start in range(0, DRAWS, 1000):  # 1,000 rows at a time: [1000, vocab] float64 tensors
        rows = [SamplingRow(temperature=temperature, top_k=top_k, top_p=top_p, stream=s)
                for s in range(start, min(start + 1000, DRAWS))]
        metadata = SamplingMetadata.from_rows(rows, vocab)
        tokens = sample(logits.float().expand(len(rows), vocab), metadata).token_ids
        counts += torch.bincount(tokens, minlength=vocab)
    return counts.double() / DRAWS


def entropy_bits(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


def draw(data: dict, path: Path, lang: str = "en") -> None:
    """Six panels, one per setting, from what sampling_knobs.json keeps."""
    T = figlang.chooser(lang)
    results, labels, vocab = data["knobs"], data["tokens"], data["vocab_size"]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9.5), dpi=110, sharex=True, sharey=True)
    x = range(SHOWN)
    for ax, r in zip(axes.flat, results, strict=True):
        kept = [p > 0 for p in r["probs"]]
        ax.bar(x, r["probs"], color=["#2b6cb0" if k else "#cccccc" for k in kept],
               label=T("probability the sampler uses", "샘플러가 쓰는 확률"))
        ax.plot(x, r["freqs"], "o", color="#c53030", markersize=3.5,
                label=T(f"share of {DRAWS:,} seeded draws", f"시드를 준 {DRAWS:,}번 추출의 비율"))
        title = T(r["title"], r["title"].replace("raw", "원래 분포").replace("temperature", "온도"))
        ax.set_title(T(f"{title}\n{r['kept']:,} of {vocab:,} tokens kept, "
                       f"entropy {r['entropy_bits']:.2f} bits",
                       f"{title}\n토큰 {vocab:,}개 중 {r['kept']:,}개 남음, "
                       f"엔트로피 {r['entropy_bits']:.2f}비트"), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=70, fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(T("probability", "확률"))
    axes[0, 0].legend(fontsize=8, loc="upper right")
    fig.suptitle(T(f"Next token after {PROMPT!r} (tiny-pydoc): the {SHOWN} most likely raw "
                   "tokens under each setting",
                   f"{PROMPT!r} 뒤의 다음 토큰 (tiny-pydoc): 설정마다, 원래 분포에서 가장 "
                   f"확률이 높은 토큰 {SHOWN}개"), fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw both editions from sampling_knobs.json, measuring nothing")
    if parser.parse_args(argv).plot_only:
        data = json.loads((HERE / "sampling_knobs.json").read_text())
        figlang.draw_both(draw, HERE / "sampling_knobs.png", data)
        return
    torch.set_num_threads(1)
    path = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    logits = next_token_logits(path, tokenizer)
    raw = torch.softmax(logits.double(), dim=-1)
    order = torch.argsort(raw, descending=True)[:SHOWN]
    labels = [tokenizer.decode([int(t)]).replace(" ", "␣") for t in order]

    results = []
    for title, temperature, top_k, top_p in KNOBS:
        p = distribution(logits, temperature, top_k, top_p)
        f = frequencies(logits, temperature, top_k, top_p)
        results.append({
            "title": title, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "kept": int((p > 0).sum()), "entropy_bits": round(entropy_bits(p), 3),
            "shown_mass": round(float(p[order].sum()), 4),
            "probs": [round(float(p[t]), 5) for t in order],
            "freqs": [round(float(f[t]), 5) for t in order],
            "max_abs_gap": round(float((p - f).abs().max()), 4),
            "drawn_outside_kept": int(((f > 0) & (p == 0)).sum()),
        })

    data = {"prompt": PROMPT, "prompt_ids": tokenizer(PROMPT).input_ids,
            "vocab_size": int(logits.shape[-1]), "draws": DRAWS,
            "tokens": labels, "token_ids": [int(t) for t in order], "knobs": results}
    figlang.draw_both(draw, HERE / "sampling_knobs.png", data)
    (HERE / "sampling_knobs.json").write_text(json.dumps(data, indent=1, ensure_ascii=False)
                                              + "\n")
    for r in results:
        print(f"{r['title']:32s} kept {r['kept']:5d}  entropy {r['entropy_bits']:6.3f} bits  "
              f"top-{SHOWN} mass {r['shown_mass']:.3f}  max |p - freq| {r['max_abs_gap']:.4f}  "
              f"drawn outside kept {r['drawn_outside_kept']}")
    top = results[0]
    print("raw top 5:", ", ".join(f"{t!r} {p:.3f}" for t, p in
                                 zip(labels[:5], top["probs"][:5], strict=True)))
    assert all(r["drawn_outside_kept"] == 0 for r in results), "a cut token was drawn"
    assert all(r["max_abs_gap"] < 4 / math.sqrt(DRAWS) for r in results), "race off its p"


if __name__ == "__main__":
    main()

"""Blocks held by a beam search on shared blocks, against the sum of its beams' block tables
(lesson 8's figure).

The script runs the real beam search (pagedllm.reference.engine.llm.LLM.beam_search) on a small
random-weight Llama checkpoint written to a temporary folder: a prompt of 22 tokens, beam width
4, 48 new tokens (ignore_eos, so every beam runs to the end), blocks of 4 token slots. A step
observer (``engine.add_step_observer``), called just before the model runs in every step, reads
the KV cache manager ``llm.engine.kv`` through its public view (``get_block_ids`` gives a copy
of a sequence's block table):

- held: the physical blocks in use in the pool (pool size minus free blocks), which is what
  the beams cost with fork and copy-on-write;
- without sharing: the sum of the lengths of the beams' block tables, which is what they would
  cost if every beam stored its whole sequence by itself;
- each beam's block table with the reference count of every block (how many beams' tables hold
  it), the copy-on-write copies so far, and how many generated tokens all beams have in common
  (their shared history).

The saving is 1 - held / without sharing, per step and over the whole search (sums over the
steps, as the paper averages memory over a serving run). The same search runs again with blocks
of 16 slots, and with widths 2, 4 and 6 for the JSON. The script checks that a second run
gives the same beams, that blocks of 16 give the same beams as blocks of 4 (the layout never
changes a result), that nothing leaked, and that the held count never exceeds the sum of the
tables. It writes beam_blocks.png, its Korean edition beam_blocks.ko.png (figlang.py) and
beam_blocks.json next to itself.

    .venv/bin/python lessons/figures/beam_blocks.py     # about 10 seconds
"""

import json
import math
import tempfile
from collections import Counter
from pathlib import Path

import figlang
import torch

from pagedllm.reference.engine.beam_search import BeamSearchParams
from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
PROMPT = [(7 * j + 3) % 256 for j in range(22)]  # 22 tokens: 5 full blocks of 4 and 2 tokens
WIDTH, MAX_TOKENS, BLOCK_SIZE = 4, 48, 4
OTHER_BLOCK_SIZE = 16
OTHER_WIDTHS = (2, 4, 6)
PAPER_ALPACA_BEAM = (37.6, 55.2)  # % saved, beam search on Alpaca (FACTS.md)
BEAM_COLORS = ["#2b6cb0", "#d97706", "#2f855a", "#c53030", "#6b46c1", "#718096"]
HELD, UNSHARED = "#1a4480", "#c53030"


def search(model_dir: str, width: int, block_size: int) -> dict:
    """One beam search, with the beams' blocks recorded at every model call."""
    llm = LLM(model_dir, block_size=block_size)
    kv = llm.engine.kv
    steps = []

    def record(engine, sched, inputs):
        seqs = [item.seq for item in sched.scheduled]
        tables = [kv.get_block_ids(s)[0] for s in seqs]  # copies, one list per KV cache group
        assert len(seqs) == kv.num_seqs, "the live beams hold every block"
        # A block's reference count is how many tables hold it: nothing else holds blocks here
        # (no prefix caching), so this is the pool's own count.
        refs = Counter(b for t in tables for b in t)
        outputs = [list(s.output_token_ids) for s in seqs]
        common = 0  # generated tokens every beam shares, from the first one on
        while all(len(o) > common for o in outputs) and len({o[common] for o in outputs}) == 1:
            common += 1
        steps.append({
            "step": len(steps),
            "beams": len(seqs),
            "held": kv.num_total_blocks - kv.num_free_blocks,
            "without_sharing": sum(len(t) for t in tables),
            "tables": tables,
            "ref_counts": [[refs[b] for b in t] for t in tables],
            "outputs": outputs,
            "common_generated_tokens": common,
            "cow_copies": kv.num_cow_copies,
        })

    llm.engine.add_step_observer(record)
    out = llm.beam_search({"prompt_token_ids": PROMPT},
                          BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS,
                                           ignore_eos=True))[0]
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and kv.num_seqs == 0, "beam search leaked blocks"
    assert all(s["held"] <= s["without_sharing"] for s in steps)
    held = sum(s["held"] for s in steps)
    unshared = sum(s["without_sharing"] for s in steps)
    return {
        "width": width, "block_size": block_size, "steps": steps,
        "beams": [{"tokens": s.tokens, "score": s.score} for s in out.sequences],
        "cow_copies": stats["cow_copies"],
        "saving_pct": 100 * (1 - held / unshared),
        "peak_held": max(s["held"] for s in steps),
        "peak_without_sharing": max(s["without_sharing"] for s in steps),
        "final_saving_pct": 100 * (1 - steps[-1]["held"] / steps[-1]["without_sharing"]),
    }


def draw(main: dict, other: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    T = figlang.chooser(lang)
    fig = plt.figure(figsize=(13, 9.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.05, 1], width_ratios=[1, 1.15],
                            hspace=0.42, wspace=0.24)
    steps = main["steps"]
    x = [s["step"] for s in steps]

    ax = fig.add_subplot(grid[0, :])
    held = [s["held"] for s in steps]
    unshared = [s["without_sharing"] for s in steps]
    ax.fill_between(x, held, unshared, step="mid", color=UNSHARED, alpha=0.12,
                    label=T("saved by sharing", "공유로 아낀 블록"))
    ax.step(x, unshared, where="mid", color=UNSHARED, lw=2,
            label=T("sum of the beams' block tables (each beam stores its own copy)",
                    "빔 블록 테이블의 합 (빔마다 제 사본을 저장할 때)"))
    ax.step(x, held, where="mid", color=HELD, lw=2.2,
            label=T("blocks held in the pool (fork + copy-on-write)",
                    "풀에서 보유한 블록 (포크 + 쓰기 시 복사)"))
    prompt_blocks = -(-len(PROMPT) // BLOCK_SIZE)
    ax.axhline(prompt_blocks, color="#888888", ls=":", lw=1)
    ax.text(MAX_TOKENS - 0.5, prompt_blocks + 0.6,
            T(f"the prompt alone: {prompt_blocks} blocks", f"프롬프트만: 블록 {prompt_blocks}개"),
            ha="right", fontsize=9, color="#555555")
    last = steps[-1]
    ax.annotate(T(f"{last['held']} held\nvs {last['without_sharing']}",
                  f"보유 {last['held']}개\n대 {last['without_sharing']}개"),
                (last["step"], last["held"]), xytext=(-70, 38), textcoords="offset points",
                fontsize=10, color=HELD, arrowprops=dict(arrowstyle="->", color=HELD))
    ax.set_xlim(-0.8, MAX_TOKENS)
    ax.set_ylim(0, max(unshared) * 1.12)
    ax.set_xlabel(T("beam-search step (one new token per beam)",
                    "빔 서치 스텝 (빔마다 새 토큰 하나)"))
    ax.set_ylabel(T(f"KV blocks of {BLOCK_SIZE} slots", f"슬롯 {BLOCK_SIZE}개짜리 KV 블록"))
    saving, copies = f"{main['saving_pct']:.1f}", main["cow_copies"]
    ax.set_title(T(f"Beam width {WIDTH}, prompt of {len(PROMPT)} tokens, {MAX_TOKENS} new "
                   f"tokens: {saving} % of the blocks saved over the whole search "
                   f"({copies} copy-on-write copies)",
                   f"빔 폭 {WIDTH}, 프롬프트 {len(PROMPT)}토큰, 새 토큰 {MAX_TOKENS}개: 서치 "
                   f"전체에서 블록의 {saving} %를 아낌 (쓰기 시 복사 {copies}번)"),
                 loc="left", fontsize=11.5)
    ax.legend(loc="upper left", fontsize=9.5, framealpha=0.95)

    ax = fig.add_subplot(grid[1, 0])
    for res, color, label in ((main, HELD, T(f"blocks of {BLOCK_SIZE}", f"블록 크기 {BLOCK_SIZE}")),
                              (other, "#d97706", T(f"blocks of {OTHER_BLOCK_SIZE}",
                                                   f"블록 크기 {OTHER_BLOCK_SIZE}"))):
        ss = res["steps"]
        ax.plot([s["step"] for s in ss],
                [100 * (1 - s["held"] / s["without_sharing"]) for s in ss], color=color, lw=1.8,
                label=T(f"{label}: {res['saving_pct']:.1f} % over the search",
                        f"{label}: 서치 전체에서 {res['saving_pct']:.1f} %"))
    lo, hi = PAPER_ALPACA_BEAM
    ax.axhspan(lo, hi, color="#2f855a", alpha=0.14,
               label=T(f"the paper's range, Alpaca, OPT-13B: {lo}–{hi} %",
                       f"논문의 범위, Alpaca, OPT-13B: {lo}–{hi} %"))
    ax2 = ax.twinx()
    ax2.step(x, [s["common_generated_tokens"] for s in steps], where="mid", color="#718096",
             lw=1.3, ls="--")
    ax2.set_ylabel(T("generated tokens that all beams share", "모든 빔이 공유하는 생성 토큰"),
                   color="#4a5568", fontsize=9.5,
                   labelpad=8)
    ax2.set_ylim(0, MAX_TOKENS * 1.25)
    ax.plot([], [], color="#718096", lw=1.3, ls="--",
            label=T("generated tokens all beams share (right axis)",
                    "모든 빔이 공유하는 생성 토큰 (오른쪽 축)"))
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_xlim(-0.8, MAX_TOKENS)
    ax.set_xlabel(T("beam-search step", "빔 서치 스텝"))
    ax.set_ylabel(T("blocks saved, % of the sum of the tables", "아낀 블록, 테이블 합의 %"))
    ax.set_title(T(f"Saving per step, width {WIDTH}", f"스텝별 절약, 폭 {WIDTH}"), loc="left",
                 fontsize=11)
    ax.legend(loc="upper left", fontsize=8.5, framealpha=0.95)

    ax = fig.add_subplot(grid[1, 1])
    tables, refs = last["tables"], last["ref_counts"]
    n_cols = max(len(t) for t in tables)
    cmap = {WIDTH: "#6b46c1", 1: None}
    for row, (table, counts) in enumerate(zip(tables, refs, strict=True)):
        y = len(tables) - 1 - row
        for col, (block, count) in enumerate(zip(table, counts, strict=True)):
            color = cmap.get(count) or ("#b794f4" if count > 1 else BEAM_COLORS[row])
            ax.add_patch(Rectangle((col, y), 0.92, 0.8, facecolor=color, edgecolor="white"))
            ax.text(col + 0.46, y + 0.4, str(block), ha="center", va="center", fontsize=8.5,
                    color="white", fontweight="bold")
        ax.text(-0.3, y + 0.4, T(f"beam {row}", f"빔 {row}"), ha="right", va="center", fontsize=10,
                color=BEAM_COLORS[row], fontweight="bold")
    ax.set_xlim(-1.9, n_cols + 0.2)
    ax.set_ylim(-1.3, len(tables) + 0.2)
    ax.axis("off")
    ax.set_title(T(f"The {WIDTH} beams' block tables at the last step (physical block ids;\n"
                   "beam 0 is the best so far, the last column is where each writes now)",
                   f"마지막 스텝에서 빔 {WIDTH}개의 블록 테이블 (물리 블록 번호;\n"
                   "빔 0이 지금까지 가장 좋은 빔, 마지막 열은 각 빔이 지금 쓰는 곳)"),
                 loc="left", fontsize=11)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="#6b46c1", label=T(f"shared by all {WIDTH} beams",
                                                  f"빔 {WIDTH}개가 모두 공유")),
               Patch(facecolor="#b794f4", label=T("shared by some", "일부가 공유")),
               Patch(facecolor="#a0aec0", label=T("the beam's own (beam colour)",
                                                  "그 빔만의 블록 (빔 색)"))]
    ax.legend(handles=handles, loc="lower center", ncol=3, fontsize=8.5, frameon=False,
              bbox_to_anchor=(0.45, -0.02))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama"), seed=0, init_std=0.2)
        main_run = search(tmp, WIDTH, BLOCK_SIZE)
        again = search(tmp, WIDTH, BLOCK_SIZE)
        other = search(tmp, WIDTH, OTHER_BLOCK_SIZE)
        widths = {f"width {w}, blocks of {b}": search(tmp, w, b)
                  for w in OTHER_WIDTHS for b in (BLOCK_SIZE, OTHER_BLOCK_SIZE)}
    assert again["beams"] == main_run["beams"], "beam search is not deterministic"
    # The same tokens; the scores may differ in float32's last digits: decode attention pads
    # the keys to whole blocks, so another block size sums over another length.
    assert [b["tokens"] for b in other["beams"]] == [b["tokens"] for b in main_run["beams"]] \
        and all(math.isclose(a["score"], b["score"], rel_tol=1e-5)
                for a, b in zip(other["beams"], main_run["beams"], strict=True)), \
        "the block size changed the beams"
    out = {
        "config": {"model": "tiny random-weight llama (tiny_config('llama'), seed 0, "
                            "init_std 0.2)",
                   "prompt_token_ids": PROMPT, "beam_width": WIDTH, "max_tokens": MAX_TOKENS,
                   "block_size": BLOCK_SIZE, "ignore_eos": True},
        "saving_pct": main_run["saving_pct"],
        "final_saving_pct": main_run["final_saving_pct"],
        "peak_held": main_run["peak_held"],
        "peak_without_sharing": main_run["peak_without_sharing"],
        "cow_copies": main_run["cow_copies"],
        "saving_pct_block_size_16": other["saving_pct"],
        "savings_by_width_and_block_size": {
            k: {"saving_pct": v["saving_pct"], "cow_copies": v["cow_copies"],
                "peak_held": v["peak_held"], "peak_without_sharing": v["peak_without_sharing"]}
            for k, v in widths.items()},
        "paper_alpaca_beam_search_pct": PAPER_ALPACA_BEAM,
        "beams": main_run["beams"],
        "steps": [{k: s[k] for k in ("step", "beams", "held", "without_sharing",
                                     "common_generated_tokens", "cow_copies", "tables",
                                     "ref_counts")} for s in main_run["steps"]],
    }
    (HERE / "beam_blocks.json").write_text(json.dumps(out, indent=1))
    figlang.draw_both(draw, HERE / "beam_blocks.png", main_run, other)
    s = main_run["steps"]
    print(f"width {WIDTH}, prompt {len(PROMPT)} tokens, {MAX_TOKENS} new tokens, blocks of "
          f"{BLOCK_SIZE}: {len(s)} model calls")
    print(f"  held per step:        {[x['held'] for x in s]}")
    print(f"  without sharing:      {[x['without_sharing'] for x in s]}")
    print(f"  common generated:     {[x['common_generated_tokens'] for x in s]}")
    print(f"  saved over the search {main_run['saving_pct']:.1f} %, at the last step "
          f"{main_run['final_saving_pct']:.1f} % ({s[-1]['held']} vs {s[-1]['without_sharing']}"
          f" blocks); copy-on-write copies {main_run['cow_copies']}")
    print(f"  blocks of {OTHER_BLOCK_SIZE}: saved {other['saving_pct']:.1f} %")
    for k, v in widths.items():
        print(f"  {k}: saved {v['saving_pct']:.1f} %, peak {v['peak_held']} vs "
              f"{v['peak_without_sharing']}, copies {v['cow_copies']}")
    print("best beams:")
    for b in main_run["beams"]:
        print(f"  {b['score']:.4f} {b['tokens']}")


if __name__ == "__main__":
    main()

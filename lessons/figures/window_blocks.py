"""A hybrid model's two block tables over a long generation (lesson 12's figure).

The script runs the real engine (pagedllm.reference's LLM) on a random Gemma 3 text checkpoint
shortened to two layers, one local (a sliding window of 8 tokens) and one global, with blocks of
4 slots: the runner groups them (``group_layers``) into two KV cache groups, a windowed one and a
full one, each with its own block table over one shared pool (``PagedKVCacheManager``). One
greedy request, a prompt of 6 tokens and 55 generated, runs to 60 tokens in the cache. A step
observer (``engine.add_step_observer``) reads, just before each forward, both block tables (a
copy, ``engine.kv.get_block_ids``), the blocks in use and the tokens in the cache.

It draws, one column per step (the tokens in the cache, this step's included):

- top and middle: each group's block table, one row per entry (entry i stands for positions
  4i to 4i + 3), a cell coloured where the entry names a block the group holds (its physical
  id written on the run) and grey where the null block stands in for a block the window gave
  back;
- bottom: the blocks each group holds, against the bound of a windowed group,
  ceil(W / block_size) + 1, and against what the two layers would hold if both kept every
  token.

It checks what the figure claims: at every step the windowed group holds exactly the entries
the step's window reads (positions L - W to L - 1 of a sequence of L tokens), at most
ceil(W / block_size) + 1 of them, and the null block everywhere before them; the full group
holds ceil(L / block_size) blocks and never the null block; the windowed table's held entries
are those of a one-group BlockSpaceManager with the same window, replayed token by token; the
tokens are the one-sequence loop's (which keeps every K/V and masks the window); nothing is
held at the end. It writes window_blocks.png, its Korean edition window_blocks.ko.png
(figlang.py) and window_blocks.json next to itself.

    .venv/bin/python lessons/figures/window_blocks.py    # a few seconds
"""

import argparse
import json
import tempfile
from pathlib import Path

import figlang
import torch

from pagedllm.reference import LLM, SamplingParams, generate, load_model
from pagedllm.reference.kv import BlockSpaceManager, SlidingWindowSpec
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
BLOCK_SIZE, WINDOW, NUM_BLOCKS = 4, 8, 32
PROMPT_LEN, MAX_TOKENS = 6, 55  # the last step computes the 60th token
LAYER_TYPES = ["sliding_attention", "full_attention"]
BOUND = -(-WINDOW // BLOCK_SIZE) + 1  # blocks a windowed group holds at most: 3

COLORS = {"windowed": "#2b6cb0", "full": "#dd6b20"}
NULL, NULL_EDGE = "#e2e8f0", "#a0aec0"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run(path: Path) -> dict:
    """One greedy request: both block tables just before every forward."""
    llm = LLM(str(path), block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS)
    engine, kv = llm.engine, llm.engine.kv
    kinds = ["windowed" if isinstance(g.kv_cache_spec, SlidingWindowSpec) else "full"
             for g in engine.kv_cache_config.kv_cache_groups]
    layers = [list(g.layer_ids) for g in engine.kv_cache_config.kv_cache_groups]
    steps = []

    def observe(engine, sched, inputs):  # just before the forward: the step's slots are booked
        (item,) = sched.scheduled
        steps.append({"tokens": item.seq.num_computed_tokens + item.num_tokens,
                      "tables": [list(t) for t in kv.get_block_ids(item.seq)],
                      "blocks_used": engine.stats()["blocks_used"]})

    engine.add_step_observer(observe)
    prompt = list(range(10, 10 + PROMPT_LEN))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return {"kinds": kinds, "layers": layers, "null_block": kv.null_block, "steps": steps,
            "prompt": prompt, "output": out[0].outputs[0].token_ids,
            "loop_output": generate(load_model(str(path)), prompt, MAX_TOKENS),
            "blocks_used_at_end": llm.stats()["blocks_used"]}


def one_group_replay() -> list[list[bool]]:
    """Held entries of a one-group BlockSpaceManager with the same window, driven as the
    scheduler drives it: the prompt booked whole, then before each decode the blocks out of
    the window given back and one slot booked (lesson 12's doctest, to 60 tokens)."""
    m = BlockSpaceManager(BLOCK_SIZE, NUM_BLOCKS, sliding_window=WINDOW)
    m.allocate(0, PROMPT_LEN)
    held = [[b != m.gpu.null_block for b in m.block_ids(0)]]
    for c in range(PROMPT_LEN, PROMPT_LEN + MAX_TOKENS - 1):  # c tokens computed so far
        m.remove_skipped_blocks(0, c)
        m.append_slots(0, 1)
        held.append([b != m.gpu.null_block for b in m.block_ids(0)])
    return held


def check(result: dict) -> dict:
    """What the figure claims."""
    assert result["kinds"] == ["windowed", "full"], result["kinds"]
    assert result["output"] == result["loop_output"], "the engine's tokens are not the loop's"
    assert result["blocks_used_at_end"] == 0, "blocks leaked"
    null, steps = result["null_block"], result["steps"]
    assert null == NUM_BLOCKS, null  # one past the pool, never handed out
    replay = one_group_replay()
    assert len(replay) == len(steps)
    for s, one_group in zip(steps, replay, strict=True):
        L = s["tokens"]
        windowed, full = s["tables"]
        first = max(0, L - WINDOW) // BLOCK_SIZE  # the entry of the window's first position
        assert len(windowed) == len(full) == ceil_div(L, BLOCK_SIZE), s
        assert windowed[:first] == [null] * first and null not in windowed[first:], s
        assert len(windowed) - first <= BOUND, s
        assert null not in full, s
        assert [b != null for b in windowed] == one_group, (s, one_group)
        assert s["blocks_used"] == len(full) + len(windowed) - first, s
    return {"tokens_at_the_end": steps[-1]["tokens"],
            "most_blocks_held": {k: max(len(s["tables"][g]) - s["tables"][g].count(null)
                                        for s in steps)
                                 for g, k in enumerate(result["kinds"])},
            "outputs_identical_to_the_loop": True}


def runs(table_rows: list[list[int]], entry: int) -> list[tuple[int, int, int]]:
    """(first column, last column, block id) of each run of one entry's block id."""
    out = []
    for col, table in enumerate(table_rows):
        if entry >= len(table):
            continue
        block = table[entry]
        if out and out[-1][2] == block and out[-1][1] == col - 1:
            out[-1] = (out[-1][0], col, block)
        else:
            out.append((col, col, block))
    return out


def draw(result: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    T = figlang.chooser(lang)
    steps, null = result["steps"], result["null_block"]
    tokens = [s["tokens"] for s in steps]
    num_entries = len(steps[-1]["tables"][1])
    fig, axes = plt.subplots(3, 1, figsize=(14, 11.5), sharex=True,
                             gridspec_kw={"height_ratios": [4, 4, 2.6]})
    titles = {"windowed": T(f"KV cache group 0: the local layer (sliding window W = {WINDOW})"
                            " — blocks behind the window go back to the pool",
                            f"KV 캐시 그룹 0: 로컬 레이어(슬라이딩 윈도우 W = {WINDOW}) — 윈도우 "
                            "뒤의 블록은 풀로 돌아간다"),
              "full": T("KV cache group 1: the global layer (full attention) — every block "
                        "is kept",
                        "KV 캐시 그룹 1: 글로벌 레이어(전체 어텐션) — 모든 블록을 유지한다")}
    for g, kind in enumerate(result["kinds"]):
        ax = axes[g]
        tables = [s["tables"][g] for s in steps]
        for L, table in zip(tokens, tables, strict=True):
            for entry, block in enumerate(table):
                held = block != null
                ax.add_patch(Rectangle((L - 0.5, entry - 0.45), 1.0, 0.9, lw=0.4,
                                       facecolor=COLORS[kind] if held else NULL,
                                       edgecolor="white" if held else NULL_EDGE,
                                       hatch=None if held else "////"))
        for entry in range(num_entries):
            for first, last, block in runs(tables, entry):
                if block == null:
                    continue
                x = (tokens[first] + tokens[last]) / 2
                ax.text(x, entry, T(f"block {block}", f"블록 {block}")
                        if last - first >= 5 else str(block),
                        ha="center", va="center", fontsize=8, color="white",
                        fontweight="bold")
        ax.set_ylim(-0.7, num_entries - 0.3)
        ax.set_yticks(range(num_entries))
        ax.set_yticklabels([f"{i} ({BLOCK_SIZE * i}-{BLOCK_SIZE * i + BLOCK_SIZE - 1})"
                            for i in range(num_entries)], fontsize=7.5)
        ax.set_ylabel(T("block-table entry (positions)", "블록 테이블 항목 (위치)"))
        ax.set_title(titles[kind], fontsize=11.5, loc="left")
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
    handles = [Patch(facecolor=COLORS["windowed"], label=T("block held, windowed group",
                                                           "윈도우 그룹이 가진 블록")),
               Patch(facecolor=COLORS["full"], label=T("block held, full group",
                                                       "전체 어텐션 그룹이 가진 블록")),
               Patch(facecolor=NULL, edgecolor=NULL_EDGE, hatch="////",
                     label=T(f"the null block (id {null}): given back, nothing held",
                             f"널 블록(id {null}): 돌려준 자리, 가진 것 없음"))]
    axes[0].legend(handles=handles, loc="upper left", fontsize=9, frameon=False)

    ax = axes[2]
    held = {kind: [len(s["tables"][g]) - s["tables"][g].count(null) for s in steps]
            for g, kind in enumerate(result["kinds"])}
    every = [2 * ceil_div(L, BLOCK_SIZE) for L in tokens]
    ax.step(tokens, every, where="mid", color="#718096", ls=":", lw=1.8,
            label=T("both layers keeping every token", "두 레이어가 모든 토큰을 유지할 때"))
    ax.step(tokens, [s["blocks_used"] for s in steps], where="mid", color="#1a202c", lw=1.8,
            label=T("blocks in use (both groups)", "사용 중인 블록(두 그룹 합)"))
    ax.step(tokens, held["full"], where="mid", color=COLORS["full"], lw=2,
            label=T("full group", "전체 어텐션 그룹"))
    ax.step(tokens, held["windowed"], where="mid", color=COLORS["windowed"], lw=2.4,
            label=T("windowed group", "윈도우 그룹"))
    ax.axhline(BOUND, color=COLORS["windowed"], ls="--", lw=1)
    ax.text(tokens[-1] + 0.6, BOUND + 0.4,
            T(f"bound: ceil(W / block_size) + 1 = {BOUND}",
              f"상한: ceil(W / block_size) + 1 = {BOUND}"),
            va="bottom", ha="left", fontsize=9, color=COLORS["windowed"])
    ax.set_ylabel(T("blocks held", "가진 블록 수"))
    ax.set_xlabel(T("tokens in the cache at the step (this step's token included)",
                    "스텝의 캐시에 있는 토큰 수 (이번 스텝의 토큰 포함)"))
    ax.set_xlim(tokens[0] - 0.8, tokens[-1] + 14)
    ax.set_xticks(range(10, tokens[-1] + 1, 10))
    ax.set_ylim(0, max(every) + 2)
    ax.legend(loc="upper left", fontsize=9, frameon=False)
    ax.grid(alpha=0.3)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    fig.suptitle(T(f"One sequence of a hybrid model, blocks of {BLOCK_SIZE} slots: a block "
                   "table per KV cache group over one pool",
                   f"하이브리드 모델의 시퀀스 하나, 슬롯 {BLOCK_SIZE}개짜리 블록: 한 풀 위에 "
                   "KV 캐시 그룹마다 블록 테이블 하나"), fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "window_blocks.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = tiny_config("gemma3", num_hidden_layers=len(LAYER_TYPES),
                         layer_types=LAYER_TYPES, sliding_window=WINDOW)
    with tempfile.TemporaryDirectory() as folder:
        path = write_random_checkpoint(Path(folder) / "gemma3", config, seed=0,
                                       init_std=0.1)
        result = run(path)
    summary = check(result)
    null = result["null_block"]
    for s in result["steps"]:
        if s["tokens"] % 8 == 4 or s is result["steps"][-1]:
            windowed, full = s["tables"]
            print(f"{s['tokens']:2d} tokens: windowed {windowed.count(null)} null + "
                  f"{[b for b in windowed if b != null]}; full {len(full)} blocks; "
                  f"{s['blocks_used']} blocks in use")
    print(f"null block {null}; at most {summary['most_blocks_held']['windowed']} windowed "
          f"blocks held; tokens identical to the loop: "
          f"{summary['outputs_identical_to_the_loop']}")
    out = {"config": {"model": "random Gemma 3 text, 2 layers", "layer_types": LAYER_TYPES,
                      "sliding_window": WINDOW, "block_size": BLOCK_SIZE,
                      "num_gpu_blocks": NUM_BLOCKS, "prompt_len": PROMPT_LEN,
                      "max_tokens": MAX_TOKENS, "greedy": True},
           **result, **summary}
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(out, indent=1))
    figlang.draw_both(draw, args.out, result)
    print(f"wrote {args.out}, {figlang.edition(args.out, 'ko')} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

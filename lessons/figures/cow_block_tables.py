"""Block tables of three parallel samples before and after copy-on-write (lesson 7's figure).

The script runs the real engine (pagedllm.reference.engine.llm.LLM) on a small random-weight Llama
checkpoint written to a temporary folder. One request: a prompt of 10 tokens, n = 3 samples of 8
tokens each (temperature 1, seed 0, ignore_eos), blocks of 4 token slots. After each step it
reads the samples' block tables (copies, ``engine.kv.get_block_ids``) and counts the tables that
hold each block: the pool's reference count, as the request runs alone. A step observer
(``engine.add_step_observer``) gives it the request and the blocks in use just before each
forward:

- after step 1: the prompt was prefilled once, into blocks 0, 1 and 2 (the last one holds 2 of
  its 4 slots); the parent forked two children, so all three samples share the three blocks
  (reference count 3); each sample drew its first token, whose K/V is not in the cache yet;
- after step 2: each sample wrote its first token's K/V at position 10, in the shared, partly
  filled block 2. Sample 0 wrote first: it got a copy of block 2 (block 3) and the count of
  block 2 fell to 2. Sample 1 got block 4 the same way, and the count fell to 1. Sample 2 then
  held block 2 alone and wrote into it in place. Blocks 0 and 1 are full: nobody writes into
  them again, and they stay shared until the request ends.

The script checks what the figure claims: the tables and counts above, 2 copies in the engine's
stats, that the copied blocks hold the same K/V as block 2 at positions 8 and 9 (every layer)
and different K/V at position 10, that each sample i equals a request of its own with seed 0 + i,
and how many blocks the request holds at its largest (11, against 15 without sharing). It draws
the two moments one above the other and writes cow_block_tables.png, its Korean edition
cow_block_tables.ko.png (figlang.py) and cow_block_tables.json next to itself.

    .venv/bin/python lessons/figures/cow_block_tables.py    # a few seconds
"""

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import figlang
import torch

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
PROMPT = list(range(10))  # token ids 0..9, so token id = position in the prompt
N, MAX_TOKENS, SEED, BLOCK_SIZE = 3, 8, 0, 4
SAMPLE_COLORS = ["#2b6cb0", "#d97706", "#2f855a", "#b83280", "#2c7a7b", "#975a16"]  # N <= 6
SHARED = "#6b46c1"  # a block more than one sample holds
COPY = "#c53030"  # the outline of a block made by copy-on-write


def params(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                          ignore_eos=True)


def snapshot(engine, group, step: int) -> dict:
    """The group's block tables (copies, from ``engine.kv.get_block_ids``) and their blocks'
    reference counts. A count is how many tables hold the block: the engine runs this request
    alone, without prefix caching, so that is the pool's own count."""
    seqs = sorted(group.seqs, key=lambda s: s.index)
    tables = {s.seq_id: engine.kv.get_block_ids(s)[0] for s in seqs}
    return {
        "step": step,
        "samples": [{"index": s.index, "seq_id": s.seq_id,
                     "block_table": tables[s.seq_id],
                     "tokens_in_cache": s.num_computed_tokens,
                     "output_token_ids": list(s.output_token_ids)} for s in seqs],
        "ref_counts": dict(sorted(Counter(b for t in tables.values() for b in t).items())),
        "blocks_used": engine.stats()["blocks_used"],
        "cow_copies": engine.stats()["cow_copies"],
    }


def run(model_dir: str) -> dict:
    llm = LLM(model_dir, block_size=BLOCK_SIZE)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params(N, SEED))
    snaps, used, groups, step = [], [], [], 0

    def observe(engine, sched, inputs):  # just before the forward: the step's slots are set
        used.append(engine.stats()["blocks_used"])
        groups[:] = [item.group for item in sched.scheduled][:1]  # the request, its samples

    engine.add_step_observer(observe)
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step <= 2:
            snaps.append(snapshot(engine, groups[0], step))
        if step == 2:
            copies_hold_the_same_kv(engine, snaps[-1])
    outputs = [s["output_token_ids"] for s in snaps[-1]["samples"]]
    return {"snapshots": snaps, "blocks_used_per_step": used,
            "first_two_tokens": outputs, "steps": step}


def copies_hold_the_same_kv(engine, snap: dict) -> None:
    """A copied block starts as the source's exact copy; then each sample writes its own token."""
    filled = len(PROMPT) % BLOCK_SIZE  # prompt tokens in the partly filled last block
    if not filled:
        return  # the prompt filled its last block: nothing was shared-and-written, no copies
    tensors = engine.runner.cache_engine  # the KV tensors: per layer [num_blocks, block_size, ...]
    last = {s["index"]: s["block_table"][-1] for s in snap["samples"]}
    for cache in (*tensors.gpu_k, *tensors.gpu_v):  # every layer, K and V
        for i in range(N - 1):
            assert torch.equal(cache[last[i]][:filled], cache[last[N - 1]][:filled])
            assert not torch.equal(cache[last[i]][filled], cache[last[N - 1]][filled])


def check(result: dict, singles: list[list[int]], full: list[list[int]]) -> dict:
    """What the figure claims, for any PROMPT, N and BLOCK_SIZE."""
    before, after = result["snapshots"]
    full_blocks = len(PROMPT) // BLOCK_SIZE  # never written again: shared to the end
    partial = len(PROMPT) % BLOCK_SIZE != 0
    parent = before["samples"][0]["block_table"]
    assert all(s["block_table"] == parent for s in before["samples"]), "fork shares every block"
    assert before["ref_counts"] == {b: N for b in parent} and before["cow_copies"] == 0
    tables = [s["block_table"] for s in after["samples"]]
    assert all(t[:full_blocks] == parent[:full_blocks] for t in tables)
    assert all(after["ref_counts"][b] == N for b in parent[:full_blocks])
    private = [t[-1] for t in tables]
    assert len(set(private)) == N and all(after["ref_counts"][b] == 1 for b in private)
    assert after["cow_copies"] == (N - 1 if partial else 0)
    if partial:
        assert tables[-1][-1] == parent[-1], "the last writer keeps the original block"
    assert singles == full, "sample i must equal a request of its own with seed + i"
    peak = max(result["blocks_used_per_step"])
    # Without sharing every sample would hold its own copy of the prompt's blocks.
    longest = len(PROMPT) + MAX_TOKENS - 1  # the last token's K/V is never computed
    without = N * -(-longest // BLOCK_SIZE)
    assert peak == without - (N - 1) * full_blocks  # sharing saves the prompt's full blocks
    return {"peak_blocks_used": peak, "peak_blocks_without_sharing": without,
            "sample_i_equals_single_request_with_seed_plus_i": singles == full}


def draw(result: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    T = figlang.chooser(lang)
    slot_w, h, gap = 1.0, 0.8, 0.45
    block_w = BLOCK_SIZE * slot_w
    after = result["snapshots"][-1]
    pool_blocks = max(int(b) for b in after["ref_counts"]) + 2  # the first blocks of the pool
    seq_gap = 2.6
    logical = max(len(s["block_table"]) for s in after["samples"])
    row_w = logical * block_w + (logical - 1) * gap  # one sample's logical blocks
    total_w = N * row_w + (N - 1) * seq_gap
    pool_w = pool_blocks * (block_w + gap) - gap
    pool_x0 = (total_w - pool_w) / 2

    def pool_x(block: int) -> float:
        return pool_x0 + block * (block_w + gap)

    fig, axes = plt.subplots(2, 1, figsize=(max(14.0, 0.29 * (total_w + 2)), 11.2))
    partial = len(PROMPT) % BLOCK_SIZE != 0
    src = result["snapshots"][0]["samples"][0]["block_table"][-1]  # the prompt's last block
    titles = [
        T(f"After step 1: the prompt is prefilled once; {N - 1} children fork from the parent "
          "and share its blocks",
          f"스텝 1 이후: 프롬프트는 한 번만 프리필되고, 자식 {N - 1}개가 부모에서 포크해 그 "
          "블록을 공유한다"),
        T(f"After step 2: each sample writes its first token's K/V at position {len(PROMPT)}, "
          + (f"so the shared block {src} is copied on write" if partial
             else "in a fresh block (the prompt filled its blocks: nothing to copy)"),
          f"스텝 2 이후: 샘플마다 첫 토큰의 K/V를 위치 {len(PROMPT)}에 쓰므로, "
          + (f"공유 블록 {src}가 쓰기 시 복사된다" if partial
             else "새 블록에 쓴다 (프롬프트가 블록을 다 채움: 복사할 것 없음)")),
    ]
    for ax, snap, title in zip(axes, result["snapshots"], titles, strict=True):
        refs = {int(b): c for b, c in snap["ref_counts"].items()}
        samples = snap["samples"]
        pool_y, logical_y = 4.4, 0.0
        written = {}  # physical slot -> (label, colour): what each slot holds now
        owner = {}  # physical block -> the one sample that holds it alone
        for s in samples:
            for pos in range(s["tokens_in_cache"]):
                block = s["block_table"][pos // BLOCK_SIZE]
                private = refs[block] == 1
                color = SAMPLE_COLORS[s["index"]] if private else SHARED
                written[block * BLOCK_SIZE + pos % BLOCK_SIZE] = (str(pos), color)
            for block in s["block_table"]:
                if refs[block] == 1:
                    owner[block] = s["index"]
        copies = ({s["block_table"][-1] for s in samples} - {src}) if snap["cow_copies"] else set()

        # The physical pool.
        for block in range(pool_blocks):
            x0 = pool_x(block)
            held = block in refs
            for off in range(BLOCK_SIZE):
                x = x0 + off * slot_w
                slot = block * BLOCK_SIZE + off
                if slot in written:
                    label, color = written[slot]
                    ax.add_patch(Rectangle((x, pool_y), slot_w, h, facecolor=color,
                                           edgecolor="white", lw=0.8))
                    ax.text(x + slot_w / 2, pool_y + h / 2, label, ha="center", va="center",
                            fontsize=10, color="white", fontweight="bold")
                else:
                    edge = "#bbbbbb" if not held else (SHARED if block not in owner
                                                       else SAMPLE_COLORS[owner[block]])
                    ax.add_patch(Rectangle((x, pool_y), slot_w, h, facecolor="white",
                                           edgecolor=edge, lw=0.6,
                                           hatch="////" if held else None))
            if block in copies:
                edge, lw = COPY, 3.0
            elif held:
                edge, lw = (SHARED if refs[block] > 1 else SAMPLE_COLORS[owner[block]]), 1.8
            else:
                edge, lw = "#aaaaaa", 1.0
            ax.add_patch(Rectangle((x0, pool_y), block_w, h, fill=False, lw=lw, edgecolor=edge))
            ax.text(x0 + block_w / 2, pool_y + h + 0.12, T(f"block {block}", f"블록 {block}"),
                    ha="center",
                    va="bottom", fontsize=10.5, fontweight="bold" if held else "normal",
                    color="black" if held else "#999999")
            if held:
                ax.text(x0 + block_w / 2, pool_y + h + 0.55,
                        T(f"ref count {refs[block]}", f"참조 카운트 {refs[block]}"),
                        ha="center", va="bottom", fontsize=10,
                        color=SHARED if refs[block] > 1 else "#333333",
                        fontweight="bold" if refs[block] > 1 else "normal")
            else:
                ax.text(x0 + block_w / 2, pool_y + h + 0.55, T("free", "빈 블록"), ha="center",
                        va="bottom", fontsize=10, color="#999999")
            if block in copies:
                ax.text(x0 + block_w / 2, pool_y - 0.1,
                        T(f"copy of\nblock {src}", f"블록 {src}의\n사본"), ha="center",
                        va="top", fontsize=10, color=COPY, fontweight="bold")
        ax.text(pool_x0 - 0.4, pool_y + h / 2, T("physical\npool", "물리\n풀"), ha="right",
                va="center",
                fontsize=11)

        # Each sample's logical view, with one arrow per block-table entry.
        for s in samples:
            i = s["index"]
            color = SAMPLE_COLORS[i]
            x_start = i * (row_w + seq_gap)
            n_cached = s["tokens_in_cache"]
            for logical, block in enumerate(s["block_table"]):
                x0 = x_start + logical * (block_w + gap)
                shared = refs[block] > 1
                for off in range(BLOCK_SIZE):
                    pos = logical * BLOCK_SIZE + off
                    x = x0 + off * slot_w
                    if pos < n_cached:
                        ax.add_patch(Rectangle((x, logical_y), slot_w, h,
                                               facecolor=SHARED if shared else color,
                                               edgecolor="white", lw=0.8))
                        ax.text(x + slot_w / 2, logical_y + h / 2, str(pos), ha="center",
                                va="center", fontsize=10, color="white", fontweight="bold")
                    elif pos == n_cached:  # the newest token: sampled, its K/V comes next step
                        ax.add_patch(Rectangle((x, logical_y), slot_w, h, facecolor="white",
                                               edgecolor=color, lw=1.4, ls="--"))
                        ax.text(x + slot_w / 2, logical_y + h / 2, str(pos), ha="center",
                                va="center", fontsize=9.5, color=color, style="italic")
                    else:
                        ax.add_patch(Rectangle((x, logical_y), slot_w, h, facecolor="white",
                                               edgecolor="#dddddd", lw=0.6))
                ax.add_patch(Rectangle((x0, logical_y), block_w, h, fill=False, lw=1.6,
                                       edgecolor=SHARED if shared else color))
                ax.add_patch(FancyArrowPatch(
                    (x0 + block_w / 2, logical_y + h + 0.05),
                    (pool_x(block) + block_w / 2, pool_y - (0.95 if block in copies else 0.1)),
                    arrowstyle="-|>", mutation_scale=14, lw=1.5, color=color, alpha=0.85,
                    shrinkA=0, shrinkB=2))
            outs = s["output_token_ids"]
            ax.text(x_start + row_w / 2, logical_y - 0.15,
                    T(f"sample {i} (seq {s['seq_id']}{', the parent' if i == 0 else ''})\n"
                      f"block table {s['block_table']}\n"
                      f"K/V stored for {n_cached} tokens\nsampled so far {outs}",
                      f"샘플 {i} (시퀀스 {s['seq_id']}{', 부모' if i == 0 else ''})\n"
                      f"블록 테이블 {s['block_table']}\n"
                      f"K/V를 저장한 토큰 {n_cached}개\n지금까지 샘플링 {outs}"),
                    ha="center", va="top", fontsize=10.5, color=color, fontweight="bold",
                    linespacing=1.35)
        used, cows = snap["blocks_used"], snap["cow_copies"]
        note = T(f"{used} blocks in use, {cows} copies so far. "
                 "Dashed: the newest sampled token, whose K/V this sample writes next step.",
                 f"사용 중인 블록 {used}개, 지금까지 복사 {cows}번. "
                 "점선: 가장 최근에 샘플링한 토큰, 그 K/V는 다음 스텝에 이 샘플이 쓴다.")
        if cows:
            order = T(", then ", ", 그다음 ").join(
                T(f"sample {i} ({N - i} → {N - i - 1})", f"샘플 {i} ({N - i} → {N - i - 1})")
                for i in range(1, N - 1))
            note = T(f"{used} blocks in use, {cows} copies: sample 0 "
                     f"copied first (ref count of block {src}: {N} → {N - 1})"
                     + (f", then {order}" if order else "")
                     + f"; sample {N - 1} then held block {src} alone and wrote in place.",
                     f"사용 중인 블록 {used}개, 복사 {cows}번: 샘플 0이 먼저 복사 "
                     f"(블록 {src}의 참조 카운트: {N} → {N - 1})"
                     + (f", 그다음 {order}" if order else "")
                     + f"; 그러자 샘플 {N - 1}은 블록 {src}를 혼자 가져 제자리에 썼다.")
        ax.text(0, -2.35, note, ha="left", va="top", fontsize=10.5)
        ax.set_title(title, fontsize=12.5, loc="left")
        ax.set_xlim(-1.6, total_w + 0.3)
        ax.set_ylim(-2.8, pool_y + h + 1.1)
        ax.axis("off")

    handles = [Patch(facecolor=SHARED, label=T("shared block (ref count > 1)",
                                               "공유 블록 (참조 카운트 > 1)"))]
    handles += [Patch(facecolor=c, label=T(f"sample {i}'s own block", f"샘플 {i}만의 블록"))
                for i, c in enumerate(SAMPLE_COLORS[:N])]
    handles += [Patch(facecolor="white", edgecolor=COPY, lw=2.5,
                      label=T("made by copy-on-write", "쓰기 시 복사로 만든 블록")),
                Patch(facecolor="white", edgecolor="#888888", hatch="////",
                      label=T("allocated, still empty", "할당되었지만 아직 빔"))]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=10,
               frameon=False)
    fig.suptitle(T(f"Parallel sampling, n = {N}: a {len(PROMPT)}-token prompt in blocks of "
                   f"{BLOCK_SIZE} slots (numbers are token positions)",
                   f"병렬 샘플링, n = {N}: {len(PROMPT)}토큰 프롬프트를 슬롯 {BLOCK_SIZE}개짜리 "
                   "블록에 (숫자는 토큰 위치)"), fontsize=13.5)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "cow_block_tables.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama"), seed=0, init_std=0.2)
        result = run(tmp)
        # The whole request, then each sample as a request of its own with seed + i.
        llm = LLM(tmp, block_size=BLOCK_SIZE)
        prompt = {"prompt_token_ids": PROMPT}
        full = [c.token_ids for c in sorted(
            llm.generate(prompt, params(N, SEED), use_tqdm=False)[0].outputs,
            key=lambda c: c.index)]
        singles = [llm.generate(prompt, params(1, SEED + i), use_tqdm=False)[0]
                   .outputs[0].token_ids for i in range(N)]
    summary = check(result, singles, full)
    for snap in result["snapshots"]:
        print(f"after step {snap['step']}: blocks in use {snap['blocks_used']}, copies "
              f"{snap['cow_copies']}, ref counts {snap['ref_counts']}")
        for s in snap["samples"]:
            print(f"  sample {s['index']} (seq {s['seq_id']}): block table {s['block_table']}, "
                  f"K/V for {s['tokens_in_cache']} tokens, sampled {s['output_token_ids']}")
    print(f"blocks in use while each step runs: {result['blocks_used_per_step']}")
    print(f"largest: {summary['peak_blocks_used']} blocks; without sharing "
          f"{summary['peak_blocks_without_sharing']}")
    print("sample i equals a single request with seed 0 + i: "
          f"{summary['sample_i_equals_single_request_with_seed_plus_i']}")
    for i, tokens in enumerate(full):
        print(f"  sample {i}: {tokens}")
    out = {"config": {"model": "tiny random-weight llama (tiny_config('llama'), seed 0, "
                               "init_std 0.2)",
                      "prompt_token_ids": PROMPT, "n": N, "max_tokens": MAX_TOKENS,
                      "temperature": 1.0, "seed": SEED, "block_size": BLOCK_SIZE},
           **result, "samples": full, **summary}
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(out, indent=1))
    figlang.draw_both(draw, args.out, result)
    print(f"wrote {args.out}, {figlang.edition(args.out, 'ko')} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

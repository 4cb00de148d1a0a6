"""Lookahead slots booked and given back: one sequence's block table over four speculative
steps (lesson 20's figure).

The script runs the real engine (pagedllm.reference's LLM) on the shipped tiny model with n-gram
proposals (``speculative_config={"method": "ngram", "num_speculative_tokens": 4}``), greedy,
blocks of 4 slots, on a prompt that repeats itself (a doctest session: ``>>> s = 'a'`` ...),
so that prompt lookup finds something to propose. A step observer
(``engine.add_step_observer``) reads, just before each forward, the sequence's block table
(a copy, ``engine.kv.get_block_ids``), how many of its tokens have their K/V in the cache, and
the proposals whose lookahead slots the scheduler booked; after the step it reads the table
again and the proposals the scheduler accepted (``spec_metrics``).

It draws the first four consecutive steps that each verified proposals, one pair of rows per
step: the slots as booked while the forward runs (cached K/V, the token computed this step, the
proposals in their lookahead slots), and the slots after verification (accepted proposals kept,
rejected ones given back, and with them every block that held only rejected proposals; the
target's own next token, which has no K/V yet, dashed). Cells show the tokens' text; each
block is labelled with its physical block id.

It checks what the figure claims: the outputs are plain decoding's, token for token; at every
step the booked table has ceil((computed + 1 + k) / 4) blocks and the kept one
ceil((computed + 1 + accepted) / 4), the kept table is a prefix of the booked one and the rest
went back to the pool; the four steps include a run accepted whole, one accepted in part and
one rejected whole that gave a block back; nothing is held at the end. It writes
spec_decode_blocks.png, its Korean edition spec_decode_blocks.ko.png (figlang.py) and
spec_decode_blocks.json next to itself.

    .venv/bin/python lessons/figures/spec_decode_blocks.py    # a few seconds
"""

import argparse
import json
from pathlib import Path

import figlang
import torch

from pagedllm.reference import LLM, SamplingParams
from pagedllm.serving.default_model import default_model_dir

HERE = Path(__file__).resolve().parent
PROMPT = ">>> s = 'a'\n>>> s\n'a'\n>>> s = 'b'\n>>> s\n"
BLOCK_SIZE, NUM_BLOCKS, MAX_TOKENS, K = 4, 32, 30, 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
STEPS_DRAWN = 4

CACHED, COMPUTED, PROPOSED = "#cbd5e0", "#2b6cb0", "#dd6b20"
ACCEPTED, REJECTED, NEXT = "#2f855a", "#c53030", "#4a5568"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run(path: str) -> dict:
    """Every step of one greedy request with n-gram proposals: the block table as booked (just
    before the forward) and as kept (after the step), the proposals and how many were kept."""
    llm = LLM(path, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
              speculative_config=NGRAM)
    engine, tokenizer = llm.engine, llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seen = {}

    def observe(engine, sched, inputs):  # just before the forward: the step's slots are booked
        item = sched.scheduled[0]
        seen.update(seq=item.seq, computed=item.seq.num_computed_tokens,
                    num_tokens=item.num_tokens, proposals=list(item.spec_token_ids),
                    booked=list(engine.kv.get_block_ids(item.seq)[0]),
                    free_booked=engine.kv.num_free_blocks)

    engine.add_step_observer(observe)
    engine.add_request("r", PROMPT, params)
    steps = []
    while engine.has_unfinished_requests():
        free_before = engine.kv.num_free_blocks
        accepted_before = engine.scheduler.spec_metrics.num_accepted_tokens
        engine.step()
        seq = seen["seq"]
        accepted = engine.scheduler.spec_metrics.num_accepted_tokens - accepted_before
        steps.append({
            "step": len(steps) + 1, "computed": seen["computed"],
            "num_tokens": seen["num_tokens"], "proposals": seen["proposals"],
            "accepted": accepted, "booked": seen["booked"],
            "kept": None if seq.is_finished else list(engine.kv.get_block_ids(seq)[0]),
            "free_before": free_before, "free_booked": seen["free_booked"],
            "free_after": engine.kv.num_free_blocks,
            "token_ids": list(seq.token_ids), "finished": seq.is_finished})
    stats = llm.stats()
    num_prompt = len(tokenizer(PROMPT).input_ids)
    plain = LLM(path, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS).generate(
        PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    texts = {t: tokenizer.decode([t]) for s in steps for t in s["token_ids"]}
    return {"steps": steps, "spec_output": steps[-1]["token_ids"][num_prompt:],
            "plain_output": plain, "num_prompt_tokens": num_prompt,
            "texts": {str(t): x for t, x in texts.items()},
            "blocks_used_at_end": stats["blocks_used"], "num_steps": stats["num_steps"],
            "spec_stats": {k: v for k, v in stats.items() if k.startswith("spec_")}}


def drawn_steps(steps: list[dict]) -> list[dict]:
    """The first STEPS_DRAWN consecutive steps that each verified proposals."""
    for i in range(len(steps) - STEPS_DRAWN + 1):
        window = steps[i:i + STEPS_DRAWN]
        if all(s["proposals"] and not s["finished"] for s in window):
            return window
    raise AssertionError("no four consecutive speculative steps: change PROMPT or MAX_TOKENS")


def check(result: dict) -> dict:
    """What the figure claims."""
    assert result["spec_output"] == result["plain_output"], "speculation changed a token"
    assert result["blocks_used_at_end"] == 0, "blocks leaked"
    for s in result["steps"]:
        if s["finished"]:
            continue
        k, a, c = len(s["proposals"]), s["accepted"], s["computed"]
        if c < result["num_prompt_tokens"]:
            continue  # the prefill
        assert len(s["booked"]) == ceil_div(c + 1 + k, BLOCK_SIZE), s
        assert len(s["kept"]) == ceil_div(c + 1 + a, BLOCK_SIZE), s
        assert s["booked"][:len(s["kept"])] == s["kept"], "the kept table is a prefix"
        returned = len(s["booked"]) - len(s["kept"])
        assert s["free_after"] == s["free_booked"] + returned, s
    window = drawn_steps(result["steps"])
    kinds = {("whole" if s["accepted"] == len(s["proposals"]) else
              "none" if s["accepted"] == 0 else "part") for s in window}
    assert kinds == {"whole", "part", "none"}, kinds
    assert any(len(s["booked"]) > len(s["kept"]) for s in window), "no block went back"
    return {"drawn_steps": [s["step"] for s in window],
            "outputs_identical_to_plain_decoding": True}


def show(text: str) -> str:
    """A token's text for a cell: a newline as ↵, a leading space as ·."""
    text = text.replace("\n", "↵")
    return "·" + text[1:] if text.startswith(" ") else text


def draw(result: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    T = figlang.chooser(lang)
    window = drawn_steps(result["steps"])
    texts = {int(t): x for t, x in result["texts"].items()}
    first = window[0]["computed"] // BLOCK_SIZE  # the first logical block drawn
    last = max(len(s["booked"]) for s in window)  # one past the last logical block drawn
    slot_w, h, gap = 1.0, 0.78, 0.35
    block_w = BLOCK_SIZE * slot_w

    def x_of(position: int) -> float:
        logical = position // BLOCK_SIZE - first
        return logical * (block_w + gap) + (position % BLOCK_SIZE) * slot_w

    width = (last - first) * (block_w + gap) - gap
    def cell(x: float, y: float, face: str, text: str, color: str, hatch) -> None:
        ax.add_patch(Rectangle((x, y), slot_w, h, facecolor=face, lw=0.8,
                               edgecolor="white" if face != "white" else "#e2e8f0"))
        if hatch:
            ax.add_patch(Rectangle((x, y), slot_w, h, fill=False, lw=0.0, hatch=hatch,
                                   edgecolor="#feb2b2" if hatch == "xx" else "#cbd5e0"))
        if text:
            ax.text(x + slot_w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5,
                    color=color, fontweight="bold", zorder=5)

    row_h, pair_h = 1.45, 3.55
    fig, ax = plt.subplots(figsize=(15.5, 2.25 + 2.1 * len(window)))
    for n, s in enumerate(window):
        y_booked = -n * pair_h
        y_after = y_booked - row_h
        c, k, a = s["computed"], len(s["proposals"]), s["accepted"]
        tokens = s["token_ids"]  # the sequence after the step
        target = tokens[c + 1:c + 2 + a]  # the target's tokens: a accepted, then the next
        label = T(f"step {s['step']}", f"스텝 {s['step']}")
        ax.text(-0.5, y_booked + h / 2, T(f"{label}\nbooked", f"{label}\n예약"), ha="right",
                va="center", fontsize=10.5, fontweight="bold")
        ax.text(-0.5, y_after + h / 2, T("after\nverification", "검증\n이후"), ha="right",
                va="center", fontsize=10.5)
        for logical in range(first, last):
            x0 = x_of(logical * BLOCK_SIZE)
            held = logical < len(s["booked"])
            kept = logical < len(s["kept"])
            for row, y in (("booked", y_booked), ("after", y_after)):
                has = held if row == "booked" else kept
                returned = row == "after" and held and not kept
                if has or returned:
                    edge, lw = (REJECTED, 2.4) if returned else ("#2d3748", 1.4)
                    ax.add_patch(Rectangle((x0, y), block_w, h, fill=False, lw=lw,
                                           edgecolor=edge, zorder=3,
                                           ls="--" if returned else "-"))
                if row == "booked" and held:
                    ax.text(x0 + block_w / 2, y + h + 0.08,
                            T(f"block {s['booked'][logical]}", f"블록 {s['booked'][logical]}"),
                            ha="center", va="bottom", fontsize=9, color="#2d3748")
                if returned:
                    ax.text(x0 + block_w / 2, y - 0.08,
                            T(f"block {s['booked'][logical]} back to the pool",
                              f"블록 {s['booked'][logical]} 풀로 반환"),
                            ha="center", va="top", fontsize=9, color=REJECTED,
                            fontweight="bold")
            if not held:
                continue  # not in the block table this step: nothing to draw
            for off in range(BLOCK_SIZE):
                pos = logical * BLOCK_SIZE + off
                x = x_of(pos)
                j = pos - c - 1  # the proposal in this slot, if any
                # the booked row
                hatch = None
                if pos < c:
                    face, text, color = CACHED, show(texts[tokens[pos]]), "#1a202c"
                elif pos == c:
                    face, text, color = COMPUTED, show(texts[tokens[pos]]), "white"
                elif j < k:
                    face, text, color = PROPOSED, show(texts[s["proposals"][j]]), "white"
                else:  # allocated with its block, still empty
                    face, text, color, hatch = "white", "", "black", "////"
                cell(x, y_booked, face, text, color, hatch)
                # the row after verification
                hatch = None
                if pos <= c:
                    face, text, color = CACHED, show(texts[tokens[pos]]), "#1a202c"
                elif j < a:
                    face, text, color = ACCEPTED, show(texts[s["proposals"][j]]), "white"
                elif j < k:
                    face, text, color, hatch = "white", show(texts[s["proposals"][j]]), \
                        REJECTED, "xx"
                elif kept:
                    face, text, color, hatch = "white", "", "black", "////"
                else:
                    face, text, color = "white", "", "black"
                if j == a:  # the target's own next token takes this position: no K/V yet
                    text, color = show(texts[target[-1]]), NEXT
                cell(x, y_after, face, text, color, hatch)
                if j == a:
                    ax.add_patch(Rectangle((x + 0.07, y_after + 0.07), slot_w - 0.14,
                                           h - 0.14, fill=False, lw=1.7, ls="--",
                                           edgecolor=NEXT, zorder=4))
        proposed = ", ".join(repr(texts[t]) for t in s["proposals"])
        note_booked = T(f"proposed {k}: {proposed}\n"
                        f"{c} tokens cached, 1 computed now, {k} lookahead slots: "
                        f"{len(s['booked'])} blocks",
                        f"제안 {k}개: {proposed}\n"
                        f"캐시된 토큰 {c}개, 지금 계산 1개, 룩어헤드 슬롯 {k}개: "
                        f"블록 {len(s['booked'])}개")
        returned = len(s["booked"]) - len(s["kept"])
        if a == k:
            verdict = T(f"all {k} accepted, +{a + 1} tokens in one step",
                        f"{k}개 모두 수락, 한 스텝에 토큰 +{a + 1}개")
        elif a == 0:
            verdict = T(f"none accepted: +1 token, {k} slots given back",
                        f"하나도 수락 안 됨: 토큰 +1개, 슬롯 {k}개 반환")
        else:
            verdict = T(f"{a} of {k} accepted: +{a + 1} tokens, {k - a} slots given back",
                        f"{k}개 중 {a}개 수락: 토큰 +{a + 1}개, 슬롯 {k - a}개 반환")
        note_after = verdict + T(f"\n{len(s['kept'])} blocks kept"
                                 + (f", {returned} returned" if returned else ""),
                                 f"\n블록 {len(s['kept'])}개 유지"
                                 + (f", {returned}개 반환" if returned else ""))
        ax.text(width + 0.6, y_booked + h / 2, note_booked, ha="left", va="center",
                fontsize=9.5)
        ax.text(width + 0.6, y_after + h / 2, note_after, ha="left", va="center",
                fontsize=9.5, color=REJECTED if returned else "#1a202c")
    handles = [Patch(facecolor=CACHED, label=T("K/V cached", "캐시된 K/V")),
               Patch(facecolor=COMPUTED, label=T("token computed this step",
                                                 "이번 스텝에 계산하는 토큰")),
               Patch(facecolor=PROPOSED, label=T("proposal in a lookahead slot",
                                                 "룩어헤드 슬롯의 제안")),
               Patch(facecolor=ACCEPTED, label=T("accepted: its K/V stays",
                                                 "수락: K/V가 남는다")),
               Patch(facecolor="white", edgecolor=REJECTED, hatch="xx",
                     label=T("rejected: slot given back", "거절: 슬롯 반환")),
               Patch(facecolor="white", edgecolor="#a0aec0", hatch="////",
                     label=T("allocated with its block, empty", "블록과 함께 할당, 비어 있음")),
               Patch(facecolor="white", edgecolor=NEXT, ls="--",
                     label=T("the target's next token (no K/V yet)",
                             "타깃의 다음 토큰 (아직 K/V 없음)"))]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9.5, frameon=False)
    ax.set_xlim(-3.2, width + 13.5)
    ax.set_ylim(-(len(window) - 1) * pair_h - row_h - 0.75, h + 0.6)
    ax.axis("off")
    fig.suptitle(T(f"Speculative decoding, n-gram proposals (k = {K}), blocks of {BLOCK_SIZE} "
                   "slots: lookahead slots are booked, then the rejected ones go back",
                   f"추측 디코딩, n-gram 제안(k = {K}), 슬롯 {BLOCK_SIZE}개짜리 블록: 룩어헤드 "
                   "슬롯을 예약하고, 거절된 슬롯은 돌려준다"), fontsize=12.5)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "spec_decode_blocks.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(default_model_dir())
    summary = check(result)
    for s in result["steps"]:
        if s["proposals"]:
            print(f"step {s['step']:2d}: {s['computed']} cached + 1, proposed "
                  f"{len(s['proposals'])}, accepted {s['accepted']}; blocks booked "
                  f"{s['booked']} kept {s['kept']}")
    print(f"drawn: steps {summary['drawn_steps']}; outputs identical to plain decoding: "
          f"{summary['outputs_identical_to_plain_decoding']}; {result['spec_stats']}")
    out = {"config": {"model": "tiny-pydoc (shipped)", "prompt": PROMPT, "greedy": True,
                      "max_tokens": MAX_TOKENS, "block_size": BLOCK_SIZE,
                      "num_gpu_blocks": NUM_BLOCKS, "speculative_config": NGRAM},
           **result, **summary}
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    figlang.draw_both(draw, args.out, result)
    print(f"wrote {args.out}, {figlang.edition(args.out, 'ko')} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tokens per step when a long prompt arrives among running decodes, with and without chunked
prefill (lesson 6's figure).

The script runs the real engine (pagedllm.reference.engine.llm.LLM) on a small random-weight Llama
checkpoint written to a temporary folder. Four short requests (prompts of 4 to 7 tokens, 30
output tokens each) start decoding; before step 6 a request with a 200-token prompt (8 output
tokens) arrives. Greedy, ignore_eos, so every request produces exactly max_tokens. Two runs:

- enable_chunked_prefill=False: a step either prefills newly admitted prompts or decodes the
  running requests. The token budget must hold a whole prompt, so it is at least max_model_len
  (256 here): the long prompt is computed in one step, and that step decodes nothing.
- enable_chunked_prefill=True, max_num_batched_tokens=32: running decodes are scheduled first
  (one token each), and the prompt fills what is left of the 32-token budget, one chunk a step.

A step observer (``engine.add_step_observer``), called just before each forward, records the
step's SchedulerOutput (who runs, how many tokens, prefill or decode). The script checks that
both runs produce the same tokens and draws, for each mode, the tokens computed per step split
into decode tokens, prefill of the short prompts and prefill of the long prompt, with the token
budget. It writes chunked_prefill.png, its Korean edition chunked_prefill.ko.png (figlang.py)
and chunked_prefill.json next to itself and prints a summary.

    .venv/bin/python lessons/figures/chunked_prefill.py     # a few seconds
"""

import json
import tempfile
from pathlib import Path

import figlang
import torch

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
SHORT_PROMPTS = [5, 7, 4, 6]  # the four requests already decoding, d0 ... d3
SHORT_OUTPUT = 30
LONG_PROMPT = 200
LONG_OUTPUT = 8
LONG_ARRIVES = 6  # added just before this step
CHUNK_BUDGET = 32  # max_num_batched_tokens with chunked prefill
MAX_MODEL_LEN = 256  # the checkpoint's positions: the budget without chunked prefill
MODES = {"whole prompts (enable_chunked_prefill=False)": False,
         f"chunked prefill (enable_chunked_prefill=True, max_num_batched_tokens="
         f"{CHUNK_BUDGET})": True}
COLORS = {"decode": "#63a4e6", "short prefill": "#1a4480", "long prefill": "#d97706"}
KO = {"decode": "디코드", "short prefill": "짧은 프롬프트의 프리필",
      "long prefill": "긴 프롬프트의 프리필", "whole prompts": "프롬프트를 통째로",
      "chunked prefill": "청크 프리필"}  # the Korean edition's words for the data's labels


def run(model_dir: str, chunked: bool) -> dict:
    # Without chunking a whole prompt must fit one step: the budget is max_model_len (256).
    llm = LLM(model_dir, block_size=16, num_gpu_blocks=64, max_num_seqs=8,
              enable_chunked_prefill=chunked,
              max_num_batched_tokens=CHUNK_BUDGET if chunked else MAX_MODEL_LEN)
    engine = llm.engine
    for i, n in enumerate(SHORT_PROMPTS):
        engine.add_request(f"d{i}", {"prompt_token_ids": [(3 * i + j + 1) % 256
                                                         for j in range(n)]},
                           SamplingParams(temperature=0, max_tokens=SHORT_OUTPUT,
                                          ignore_eos=True))
    recorded = []
    budget = engine.config.scheduler_config.max_num_batched_tokens

    def observe(engine, sched, inputs):  # just before the forward: the step's work
        tokens = {"decode": 0, "short prefill": 0, "long prefill": 0}
        for item in sched.scheduled:
            if not item.seq.is_prefill:
                tokens["decode"] += item.num_tokens
            elif item.group.request_id == "long":
                tokens["long prefill"] += item.num_tokens
            else:
                tokens["short prefill"] += item.num_tokens
        recorded.append({"scheduled": [[i.group.request_id, i.num_tokens,
                                        "prefill" if i.seq.is_prefill else "decode"]
                                       for i in sched.scheduled],
                         "tokens": tokens, "budget": budget})

    engine.add_step_observer(observe)
    tokens, steps, first_token = {}, [], {}
    while engine.has_unfinished_requests():
        if len(steps) == LONG_ARRIVES:
            engine.add_request("long", {"prompt_token_ids": [(7 * j + 2) % 256
                                                             for j in range(LONG_PROMPT)]},
                               SamplingParams(temperature=0, max_tokens=LONG_OUTPUT,
                                              ignore_eos=True))
        outputs = engine.step()
        if len(recorded) == len(steps):  # the observer is not called in a step that runs nothing
            recorded.append({"scheduled": [], "tokens": {"decode": 0, "short prefill": 0,
                                                         "long prefill": 0}, "budget": budget})
        rec = recorded[-1]
        rec["step"] = len(steps)
        for o in outputs:
            if o.outputs[0].token_ids and o.request_id not in first_token:
                first_token[o.request_id] = len(steps)
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
        steps.append(rec)
    return {"steps": steps, "tokens": tokens, "first_token_step": first_token,
            "stats": engine.stats()}


def summary(res: dict) -> dict:
    steps = res["steps"]
    after = [r for r in steps if r["step"] >= LONG_ARRIVES and r["tokens"]["long prefill"]]
    return {
        "steps": len(steps),
        "budget": steps[0]["budget"],
        "max_tokens_in_a_step_after_arrival": max(sum(r["tokens"].values())
                                                  for r in steps[LONG_ARRIVES:]),
        "steps_with_long_prefill": [r["step"] for r in after],
        "decodes_in_those_steps": [r["tokens"]["decode"] for r in after],
        "steps_without_any_decode_after_step_0": [r["step"] for r in steps[1:]
                                                   if r["tokens"]["decode"] == 0],
        "long_first_token_step": res["first_token_step"]["long"],
        "long_first_token_steps_after_arrival": res["first_token_step"]["long"] - LONG_ARRIVES,
        "short_requests_finish_step": max(
            r["step"] for r in steps for name, _, _ in r["scheduled"] if name.startswith("d")),
        "prefill_tokens": res["stats"]["prefill_tokens"],
        "decode_tokens": res["stats"]["decode_tokens"],
    }


LOW_TOP = 40  # the lower axes show 0-40 tokens: a 4-token decode bar is a tenth of their height
HIGH = (185, 270)  # the cut-off upper axes of the whole-prompt run: the 200-token step, budget 256


def plot(results: dict, path: Path, lang: str = "en") -> None:
    """Two runs, one above the other, on a y-axis of 0-40 tokens, where a decode bar of 4 tokens
    is plainly visible. The whole-prompt run's 200-token step and its 256-token budget do not fit
    there: its axis is broken, with a short upper part for 185-270 tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    n_steps = max(len(r["steps"]) for r in results.values())
    fig, (high, low_whole, low_chunked) = plt.subplots(
        3, 1, figsize=(12, 8.6), sharex=True, gridspec_kw={"height_ratios": [1, 2, 2.4]})
    (whole_title, whole), (chunked_title, chunked) = results.items()

    def bars(ax, steps):
        x = [r["step"] for r in steps]
        bottom = [0] * len(steps)
        for kind, color in COLORS.items():
            vals = [r["tokens"][kind] for r in steps]
            ax.bar(x, vals, bottom=bottom, width=0.8, color=color, label=T(kind, KO[kind]))
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        return bottom

    def decode_counts(ax, steps):  # how many running requests got their next token this step
        for r in steps:
            d = r["tokens"]["decode"]
            ax.text(r["step"], -4.5, str(d), ha="center", va="center", fontsize=8,
                    color="#1a4480" if d else "#c53030", fontweight="bold")
        ax.text(-0.6, -4.5, T("decodes:", "디코드:"), ha="right", va="center", fontsize=8)

    def title(ax, name, res):
        s = summary(res)
        stalled = s["steps_without_any_decode_after_step_0"]
        largest = s["max_tokens_in_a_step_after_arrival"]
        mode = name.split(" (")[0]
        ax.set_title(T(f"{name}\nlargest step after the arrival: {largest} tokens; steps in "
                       f"which the running requests get no token: {stalled or 'none'}; "
                       f"all done after {s['steps']} steps",
                       f"{name.replace(mode, KO[mode])}\n도착 뒤 가장 큰 스텝: 토큰 {largest}개; "
                       f"실행 중인 요청이 토큰을 받지 못한 스텝: {stalled or '없음'}; "
                       f"{s['steps']} 스텝 뒤 모두 끝남"), fontsize=10.5, loc="left")

    def arrival(ax, y):
        ax.axvline(LONG_ARRIVES - 0.5, color="#555555", linestyle=":", linewidth=1)
        if y is not None:
            ax.text(LONG_ARRIVES - 0.8, y, T(f"the {LONG_PROMPT}-token\nprompt arrives",
                                             f"{LONG_PROMPT}토큰\n프롬프트 도착"),
                    ha="right", va="center", fontsize=9, color="#555555")

    def first_token(ax, res, top, text_y):
        first = res["first_token_step"]["long"]
        ax.annotate(T(f"its first token: step {first}", f"그 첫 토큰: 스텝 {first}"),
                    xy=(first + 0.2, top[first] + 0.5),
                    xytext=(first + 3, text_y), fontsize=9, color="#9a5200",
                    arrowprops={"arrowstyle": "->", "color": "#9a5200"})

    # The whole-prompt run: the same bars on both parts of its broken axis.
    for ax in (high, low_whole):
        top = bars(ax, whole["steps"])
        arrival(ax, 24 if ax is low_whole else None)
    budget = summary(whole)["budget"]
    high.axhline(budget, color="black", linestyle="--", linewidth=1)
    high.text(n_steps - 0.5, budget - 10,
              T(f"token budget per step: {budget}", f"스텝당 토큰 예산: {budget}"), ha="right",
              fontsize=9)
    first_token(high, whole, top, 225)
    high.set_ylim(*HIGH)
    low_whole.set_ylim(-8, LOW_TOP)
    high.spines["bottom"].set_visible(False)
    low_whole.spines["top"].set_visible(False)
    high.tick_params(bottom=False)
    for ax, y in ((high, 0), (low_whole, 1)):  # the diagonal marks of a cut axis
        ax.plot([0, 1], [y, y], transform=ax.transAxes, linestyle="none", marker=[(-1, -0.6),
                (1, 0.6)], markersize=10, color="black", clip_on=False)
    title(high, whole_title, whole)
    decode_counts(low_whole, whole["steps"])
    low_whole.legend(loc="upper right", fontsize=9, framealpha=0.95)
    low_whole.set_ylabel(T("tokens computed in the step", "스텝에서 계산한 토큰"), y=0.75)

    # The chunked run fits the lower scale whole.
    top = bars(low_chunked, chunked["steps"])
    arrival(low_chunked, 24)
    budget = summary(chunked)["budget"]
    low_chunked.axhline(budget, color="black", linestyle="--", linewidth=1)
    low_chunked.text(n_steps - 0.5, budget + 1.2,
                     T(f"token budget per step: {budget}", f"스텝당 토큰 예산: {budget}"),
                     ha="right", fontsize=9)
    first_token(low_chunked, chunked, top, 22)
    low_chunked.set_ylim(-8, LOW_TOP)
    title(low_chunked, chunked_title, chunked)
    decode_counts(low_chunked, chunked["steps"])
    low_chunked.set_ylabel(T("tokens computed in the step", "스텝에서 계산한 토큰"))
    low_chunked.set_xlim(-2.5, n_steps)
    low_chunked.set_xlabel(T("engine step", "엔진 스텝"))
    for ax in (low_whole, low_chunked):
        ax.set_yticks([0, 10, 20, 30, 40])
    fig.tight_layout()
    fig.subplots_adjust(hspace=0.05)
    # tight_layout packs the chunked run's title against the axes above: move that panel down.
    pos = low_chunked.get_position()
    low_chunked.set_position([pos.x0, pos.y0, pos.width, pos.height - 0.07])
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama"), seed=0, init_std=0.2)
        results = {title: run(tmp, chunked) for title, chunked in MODES.items()}
    whole, chunked = results.values()
    same = whole["tokens"] == chunked["tokens"]
    assert same, "chunked prefill changed the tokens"
    out = {"config": {"model": "tiny random-weight llama (tiny_config('llama'), seed 0, "
                               "init_std 0.2), max_model_len 256",
                      "short_prompts": SHORT_PROMPTS, "short_output": SHORT_OUTPUT,
                      "long_prompt": LONG_PROMPT, "long_output": LONG_OUTPUT,
                      "long_arrives_before_step": LONG_ARRIVES, "chunk_budget": CHUNK_BUDGET,
                      "block_size": 16, "num_gpu_blocks": 64},
           "same_tokens_in_both_modes": same,
           "modes": {title: {"chunked": MODES[title], "summary": summary(res),
                             "steps": res["steps"]} for title, res in results.items()}}
    (HERE / "chunked_prefill.json").write_text(json.dumps(out, indent=1))
    figlang.draw_both(plot, HERE / "chunked_prefill.png", results)
    for title, res in results.items():
        s = summary(res)
        print(title)
        print(f"  budget {s['budget']}, steps {s['steps']}, largest step after arrival "
              f"{s['max_tokens_in_a_step_after_arrival']} tokens, long prefill in steps "
              f"{s['steps_with_long_prefill']} with decodes {s['decodes_in_those_steps']}, "
              f"steps with no decode {s['steps_without_any_decode_after_step_0']}, long's "
              f"first token at step {s['long_first_token_step']}, short requests done at step "
              f"{s['short_requests_finish_step']}")
    print(f"same tokens in both modes: {same}")


if __name__ == "__main__":
    main()

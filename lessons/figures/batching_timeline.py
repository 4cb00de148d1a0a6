"""Which request runs at which step, under static and under continuous batching (lesson 4's figure).

The script runs the real engine (pagedllm.reference.engine.llm.LLM) on a small random-weight Llama
checkpoint written to a temporary folder. Eight requests are queued at once, with prompts of 3 to
9 tokens and outputs of 4 to 24 tokens (greedy, ignore_eos, so each produces exactly max_tokens),
and at most four run at a time (max_num_seqs=4). The same workload runs twice:

- batching="static": the traditional baseline. Four requests form a batch, padded to the
  longest prompt, and the batch runs until its last member finishes; only then the next four.
  It runs on the contiguous layout (kv_layout="contiguous"), as the systems it stands for did:
  each request reserves a slab of max_model_len (256) slots, and the pool holds four.
- batching="continuous": the scheduler rebuilds the batch every step; a request that finishes
  leaves at once and a waiting one takes its place. Paged memory, blocks of 4 slots.

A step observer (``engine.add_step_observer``), called just before each forward, records the
step's SchedulerOutput (which sequences run, how many tokens each computes, how many padding rows
static batching adds) and the scheduler's queues as the step sees them. It checks that both
runs produce the same tokens, then draws one row per request and one column per step:

- prefill (the prompt's tokens computed), decode (one new token), waiting in the queue,
  admitted but not scheduled this step (continuous batching without chunked prefill: a step that
  admits prompts decodes nothing), and, in static batching, finished but still holding its row
  and its memory until the whole batch is done.

It writes batching_timeline.png, its Korean edition batching_timeline.ko.png (figlang.py) and
batching_timeline.json next to itself and prints a summary.

    .venv/bin/python lessons/figures/batching_timeline.py     # a few seconds
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
PROMPT_LENS = [5, 9, 3, 7, 6, 4, 8, 5]  # tokens per prompt, request r0 ... r7
OUTPUT_LENS = [6, 24, 4, 10, 16, 5, 12, 8]  # max_tokens per request (ignore_eos: exact)
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 256  # the checkpoint's positions
MEMORY = {  # static: the traditional layout, a slab of max_model_len slots reserved per request
    # (room for MAX_NUM_SEQS of them); continuous: paged blocks of 4 slots, taken on demand
    "static": dict(kv_layout="contiguous", reservation_policy="max", block_size=4,
                   num_gpu_blocks=MAX_NUM_SEQS * MAX_MODEL_LEN // 4),
    "continuous": dict(kv_layout="paged", block_size=4, num_gpu_blocks=128),
}
MODES = ("static", "continuous")
STATES = {  # state -> (label, face colour, hatch)
    "prefill": ("prefill (prompt computed)", "#1a4480", None),
    "decode": ("decode (one new token)", "#63a4e6", None),
    "waiting": ("waiting in the queue", "#e2e2e2", None),
    "stalled": ("running, skipped: this step only prefills new prompts", "#fff3c4", "..."),
    "padding": ("finished, still holding its row (padding)", "#f4b6b6", "///"),
}
STATES_KO = {  # the Korean edition's legend
    "prefill": "프리필 (프롬프트 계산)",
    "decode": "디코드 (새 토큰 하나)",
    "waiting": "큐에서 대기",
    "stalled": "실행 중이지만 건너뜀: 이 스텝은 새 프롬프트만 프리필",
    "padding": "끝났지만 행을 계속 차지 (패딩)",
}


def prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j + 3) % 256 for j in range(PROMPT_LENS[i])]


def queues(scheduler) -> dict:
    """Who is running (static batching: finished ones too, still holding their rows) and who
    waits: the scheduler's queues, read, never changed."""
    return {"running": [g.request_id for g in scheduler.running],
            "running_finished": [g.request_id for g in scheduler.running if g.is_finished],
            "waiting": [g.request_id for g in scheduler.waiting]}


def run(model_dir: str, batching: str) -> dict:
    """Run the workload to the end; return per-step records and every request's tokens."""
    llm = LLM(model_dir, max_num_seqs=MAX_NUM_SEQS, batching=batching, **MEMORY[batching])
    engine = llm.engine
    names = [f"r{i}" for i in range(len(PROMPT_LENS))]
    for i, name in enumerate(names):
        engine.add_request(name, {"prompt_token_ids": prompt(i)},
                           SamplingParams(temperature=0, max_tokens=OUTPUT_LENS[i],
                                          ignore_eos=True))
    recorded = []

    def observe(engine, sched, inputs):  # just before the forward, as the engine sees the step
        recorded.append({
            "scheduled": [[item.group.request_id, item.num_tokens,
                           "prefill" if item.seq.is_prefill else "decode"]
                          for item in sched.scheduled],
            "padding_rows": sum(sched.padding_rows),
            **queues(engine.scheduler),
        })

    engine.add_step_observer(observe)
    tokens, finished_at, steps = {}, {}, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if len(recorded) == len(steps):  # the observer is not called in a step that runs
            # nothing; such a step changed no queue after scheduling, so they read the same now
            recorded.append({"scheduled": [], "padding_rows": 0, **queues(engine.scheduler)})
        record = recorded[-1]
        record["step"] = len(steps)
        record["blocks_used"] = engine.stats()["blocks_used"]
        record["finished"] = [o.request_id for o in outputs if o.finished]
        for o in outputs:
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
                finished_at[o.request_id] = len(steps)
        steps.append(record)
    return {"names": names, "steps": steps, "tokens": tokens, "finished_at": finished_at}


def states(res: dict) -> dict[str, list[str | None]]:
    """Each request's state at each step (None: not in the engine)."""
    grid = {name: [None] * len(res["steps"]) for name in res["names"]}
    for t, rec in enumerate(res["steps"]):
        for name in rec["waiting"]:
            grid[name][t] = "waiting"
        for name in rec["running"]:
            grid[name][t] = "stalled"
        for name in rec["running_finished"]:
            grid[name][t] = "padding"
        for name, _, kind in rec["scheduled"]:
            grid[name][t] = kind
    return grid


def summary(res: dict) -> dict:
    steps = res["steps"]
    useful = sum(n for rec in steps for _, n, _ in rec["scheduled"])
    padding = sum(rec["padding_rows"] for rec in steps)
    finish = res["finished_at"]
    first = {name: next(t for t, rec in enumerate(steps)
                        if any(s[0] == name for s in rec["scheduled"])) for name in res["names"]}
    return {
        "steps": len(steps),
        "finish_step": finish,
        "mean_finish_step": sum(finish.values()) / len(finish),
        "first_scheduled_step": first,
        "token_rows_useful": useful,
        "token_rows_padding": padding,
        "padding_share": padding / (useful + padding),
        "stalled_cells": sum(row.count("stalled") for row in states(res).values()),
        "peak_blocks_used": max(rec["blocks_used"] for rec in steps),
    }


def plot(results: dict, path: Path, lang: str = "en") -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    T = figlang.chooser(lang)

    n_steps = max(len(r["steps"]) for r in results.values())
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.6), sharex=True)
    for ax, mode in zip(axes, MODES, strict=True):
        res = results[mode]
        grid = states(res)
        names = res["names"]
        for row, name in enumerate(names):
            for t, state in enumerate(grid[name]):
                if state is None:
                    continue
                _, color, hatch = STATES[state]
                ax.add_patch(Rectangle((t, row - 0.42), 1, 0.84, facecolor=color, hatch=hatch,
                                       edgecolor="white" if hatch is None else "#b08a00"
                                       if state == "stalled" else "#c05050", linewidth=0.5))
            done = res["finished_at"][name]
            ax.plot(done + 1, row, marker="|", color="black", markersize=13, mew=2)
        s = summary(res)
        ax.axvline(s["steps"], color="black", linestyle="--", linewidth=1)
        ax.text(s["steps"] + 0.3, len(names) - 1,
                T(f"all done after {s['steps']} steps", f"{s['steps']} 스텝 뒤 모두 끝남"),
                fontsize=10, va="center")
        labels = [T(f"{name}: prompt {PROMPT_LENS[i]}, output {OUTPUT_LENS[i]}",
                    f"{name}: 프롬프트 {PROMPT_LENS[i]}, 출력 {OUTPUT_LENS[i]}")
                  for i, name in enumerate(names)]
        ax.set_yticks(range(len(names)), labels, fontsize=9)
        ax.set_ylim(len(names) - 0.5, -0.5)
        title = {"static": T("static (request-level) batching: batches of 4, each run until "
                             "its longest member ends",
                             "정적(요청 단위) 배치: 4개씩 묶은 배치를 가장 긴 요청이 끝날 때까지 "
                             "실행"),
                 "continuous": T("continuous (iteration-level) batching: the batch is rebuilt "
                                 "every step, at most 4 running",
                                 "연속(반복 단위) 배치: 배치를 스텝마다 다시 구성, 최대 4개 "
                                 "실행")}[mode]
        pad, rows = s["token_rows_padding"], s["token_rows_useful"] + s["token_rows_padding"]
        mean = f"{s['mean_finish_step']:.1f}"
        ax.set_title(T(f"{title}\nmean finish step {mean}; {pad} of {rows} computed token rows "
                       "are padding",
                       f"{title}\n평균 종료 스텝 {mean}; 계산한 토큰 행 {rows}개 중 {pad}개가 "
                       "패딩"), fontsize=10.5, loc="left")
    axes[-1].set_xlim(0, n_steps + 9)
    axes[-1].set_xlabel(T("engine step (one call of LLMEngine.step())   |  marks the step a "
                          "request finishes",
                          "엔진 스텝 (LLMEngine.step() 호출 한 번)   |  표시는 요청이 끝나는 "
                          "스텝"))
    handles = [Patch(facecolor=c, hatch=h, edgecolor="#888888", label=T(label, STATES_KO[key]))
               for key, (label, c, h) in STATES.items()]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama"), seed=0, init_std=0.2)
        results = {mode: run(tmp, mode) for mode in MODES}
    same = results["static"]["tokens"] == results["continuous"]["tokens"]
    assert same, "static and continuous batching produced different tokens"
    out = {"config": {"model": "tiny random-weight llama (tiny_config('llama'), seed 0, "
                               "init_std 0.2)",
                      "prompt_lens": PROMPT_LENS, "output_lens": OUTPUT_LENS,
                      "max_num_seqs": MAX_NUM_SEQS, "memory": MEMORY,
                      "all requests queued before the first step": True},
           "same_tokens_in_both_modes": same,
           "modes": {mode: {"summary": summary(res), "steps": res["steps"]}
                     for mode, res in results.items()}}
    (HERE / "batching_timeline.json").write_text(json.dumps(out, indent=1))
    figlang.draw_both(plot, HERE / "batching_timeline.png", results)
    for mode in MODES:
        s = out["modes"][mode]["summary"]
        print(f"{mode:10}  steps {s['steps']:3}  mean finish step {s['mean_finish_step']:5.1f}  "
              f"padding rows {s['token_rows_padding']:3} of "
              f"{s['token_rows_useful'] + s['token_rows_padding']} "
              f"({100 * s['padding_share']:.0f} %)  stalled request-steps {s['stalled_cells']}  "
              f"peak blocks {s['peak_blocks_used']}")
        print(f"{'':10}  finish step per request: {s['finish_step']}")
    print(f"same tokens in both modes: {same}")


if __name__ == "__main__":
    main()

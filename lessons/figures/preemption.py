"""Preemption in a KV pool that is too small, by recompute and by swap (lesson 5's figure).

The script runs the real engine (pagedllm.reference.engine.llm.LLM) on a small random-weight Llama
checkpoint written to a temporary folder. Eight requests are queued at once: prompts of 10 to
22 tokens, outputs of 18 to 34 tokens (greedy, ignore_eos, so each produces exactly max_tokens).
The pool has 24 blocks of 4 token slots, 96 slots: five prompts fit at the start, and the eight
requests together grow to 332 tokens, so the running requests outgrow the pool and the scheduler
must preempt. The same workload runs three times:

- preemption_mode="recompute": a victim drops its blocks and goes back to the front of the queue;
  when it is admitted again, its prompt and the tokens it had generated are prefilled again;
- preemption_mode="swap" (swap_space_blocks=32): a victim's blocks are copied to the CPU pool and
  come back when enough GPU blocks are free; while anything is swapped out, nothing is admitted;
- a pool of 256 blocks, where nothing is preempted: the reference answer.

It checks that all three runs produce the same tokens and that the preemption counters moved.
A step observer (``engine.add_step_observer``), called just before each forward, records the
step's SchedulerOutput (who runs, how many tokens, who was preempted); ``engine.stats()`` is read
after each step (blocks, queues, swap-ins).
The figure has one column per mode:

- top: KV blocks in use on the GPU (and, for swap, blocks parked in the CPU pool) against the
  pool size, with every preemption marked;
- middle: how many requests are running, waiting and swapped out;
- bottom: tokens computed per step: decode, first prefill of a prompt, and prefill again of what
  a recomputed request had already computed once (the price of recompute).

It writes preemption.png, its Korean edition preemption.ko.png (figlang.py) and preemption.json
next to itself and prints a summary.

    .venv/bin/python lessons/figures/preemption.py     # a few seconds
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
PROMPT_LENS = [14, 20, 10, 17, 22, 12, 16, 19]  # tokens per prompt, request r0 ... r7
OUTPUT_LENS = [30, 24, 34, 20, 28, 18, 26, 22]  # max_tokens (ignore_eos: exact)
BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 24
SWAP_SPACE_BLOCKS = 32
BIG_POOL = 256
MODES = ("recompute", "swap")
COLORS = {"running": "#2b6cb0", "waiting": "#b8b8b8", "swapped": "#d97706",
          "decode": "#63a4e6", "prefill": "#1a4480", "recompute": "#c53030",
          "gpu": "#2b6cb0", "cpu": "#d97706"}


def prompt(i: int) -> list[int]:
    return [(13 * i + 5 * j + 1) % 256 for j in range(PROMPT_LENS[i])]


def run(model_dir: str, mode: str, num_gpu_blocks: int) -> dict:
    llm = LLM(model_dir, block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks,
              swap_space_blocks=SWAP_SPACE_BLOCKS if mode == "swap" else 0,
              preemption_mode=mode, max_num_seqs=8)
    engine = llm.engine
    for i in range(len(PROMPT_LENS)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt(i)},
                           SamplingParams(temperature=0, max_tokens=OUTPUT_LENS[i],
                                          ignore_eos=True))
    recorded = []

    def record(engine, sched, inputs):  # just before the forward: who runs, who was preempted
        tokens = {"decode": 0, "prefill": 0, "recompute": 0}
        for item in sched.scheduled:
            if not item.seq.is_prefill:
                tokens["decode"] += item.num_tokens
            elif item.seq.output_token_ids:  # a prefill of a request that had generated tokens
                tokens["recompute"] += item.num_tokens
            else:
                tokens["prefill"] += item.num_tokens
        recorded.append({
            "scheduled": [[i.group.request_id, i.num_tokens] for i in sched.scheduled],
            "tokens": tokens,
            "preempted": [g.request_id for g in sched.preempted],
        })

    engine.add_step_observer(record)
    tokens, steps, before = {}, [], engine.stats()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        stats = engine.stats()
        if len(recorded) == len(steps):  # the observer is not called in a step that runs nothing
            assert all(stats[k] == before[k] for k in ("preemptions_recompute",
                                                       "preemptions_swap")), \
                "a step that ran nothing preempted: its victims would go unrecorded"
            recorded.append({"scheduled": [],
                             "tokens": {"decode": 0, "prefill": 0, "recompute": 0},
                             "preempted": []})
        rec = recorded[-1]
        rec.update(swapped_in=stats["swap_ins"] - before["swap_ins"],
                   step=len(steps), blocks_used=stats["blocks_used"],
                   cpu_blocks=stats["swapped_blocks"], running=stats["running"],
                   waiting=stats["waiting"], swapped=stats["swapped"],
                   finished=[o.request_id for o in outputs if o.finished])
        for o in outputs:
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
        steps.append(rec)
        before = stats
    final = engine.stats()
    assert final["blocks_used"] == 0 and final["swapped_blocks"] == 0, "blocks leaked"
    return {"steps": steps, "tokens": tokens, "stats": final}


def summary(res: dict) -> dict:
    steps, stats = res["steps"], res["stats"]
    swapped_out = sum(max(0, b["cpu_blocks"] - a["cpu_blocks"])
                      for a, b in zip([{"cpu_blocks": 0}, *steps], steps, strict=False))
    return {
        "steps": len(steps),
        "preemptions_recompute": stats["preemptions_recompute"],
        "preemptions_swap": stats["preemptions_swap"],
        "swap_ins": stats["swap_ins"],
        "blocks_swapped_out": swapped_out,
        "prompt_tokens": sum(PROMPT_LENS),
        "prefill_tokens": stats["prefill_tokens"],
        "recomputed_tokens": sum(r["tokens"]["recompute"] for r in steps),
        "decode_tokens": stats["decode_tokens"],
        "peak_blocks_used": max(r["blocks_used"] for r in steps),
        "mean_usage": sum(r["blocks_used"] for r in steps) / len(steps) / NUM_GPU_BLOCKS,
        "preemption_events": [[r["step"], g] for r in steps for g in r["preempted"]],
        "steps_with_swapped_and_waiting": sum(1 for r in steps
                                              if r["swapped"] and r["waiting"]),
    }


def plot(results: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    n_steps = max(len(r["steps"]) for r in results.values())
    fig, axes = plt.subplots(3, 2, figsize=(13, 9.2), sharex=True,
                             gridspec_kw={"height_ratios": [1.15, 1, 1]})
    for col, mode in enumerate(MODES):
        res = results[mode]
        steps, s = res["steps"], summary(res)
        x = [r["step"] for r in steps]
        ax = axes[0, col]
        ax.step(x, [r["blocks_used"] for r in steps], where="mid", color=COLORS["gpu"],
                label=T("GPU blocks in use", "사용 중인 GPU 블록"))
        if mode == "swap":
            ax.step(x, [r["cpu_blocks"] for r in steps], where="mid", color=COLORS["cpu"],
                    label=T("blocks swapped out to the CPU pool", "CPU 풀로 스왑 아웃된 블록"))
        ax.axhline(NUM_GPU_BLOCKS, color="black", linestyle="--", linewidth=1)
        ax.text(0.5, NUM_GPU_BLOCKS + 0.6,
                T(f"GPU pool: {NUM_GPU_BLOCKS} blocks of {BLOCK_SIZE}",
                  f"GPU 풀: 크기 {BLOCK_SIZE}의 블록 {NUM_GPU_BLOCKS}개"), fontsize=9)
        ax.set_ylim(0, NUM_GPU_BLOCKS + 9)
        ax.set_ylabel(T("KV blocks", "KV 블록"))
        count = s["preemptions_recompute"] + s["preemptions_swap"]
        swap_ins, out, again = s["swap_ins"], s["blocks_swapped_out"], s["recomputed_tokens"]
        detail = [T(f"{swap_ins} swap-ins, {out} blocks copied out and back",
                    f"스왑 인 {swap_ins}번, 블록 {out}개를 내보냈다 되가져옴")
                  ] if mode == "swap" else []
        if again:  # swap falls back to recompute when the CPU pool is full
            detail.append(T(f"{again} tokens computed a second time",
                            f"토큰 {again}개를 두 번 계산"))
        by_recompute = s["preemptions_recompute"] if mode == "swap" else 0
        ax.set_title(f"preemption_mode=\"{mode}\"\n"
                     + T(f"{s['steps']} steps, {count} preemptions",
                         f"{s['steps']} 스텝, 선점 {count}번")
                     + (T(f" ({by_recompute} by recompute)", f" (재계산으로 {by_recompute}번)")
                        if by_recompute else "")
                     + ", " + ", ".join(detail), fontsize=10.5, loc="left")
        for step, _ in s["preemption_events"]:
            for row in range(3):
                axes[row, col].axvline(step, color="#c53030", linewidth=0.8, alpha=0.6)
        by_step = {}
        for step, victim in s["preemption_events"]:
            by_step.setdefault(step, []).append(victim)
        for step, victims in by_step.items():
            ax.text(step, NUM_GPU_BLOCKS + 3.2, "\n".join(victims), color="#c53030",
                    fontsize=9, fontweight="bold", ha="center", va="bottom")
        ax.plot([], [], color="#c53030", linewidth=0.8, label=T("preemption (victim named above)",
                                                        "선점 (위에 적은 것이 희생자)"))
        ax.legend(loc="lower right", fontsize=8.5, framealpha=0.9)

        ax = axes[1, col]
        kinds = ["running", "waiting", "swapped"]
        ax.stackplot(x, *[[r[k] for r in steps] for k in kinds], step="mid",
                     colors=[COLORS[k] for k in kinds], alpha=0.9,
                     labels=[T(k, {"running": "실행", "waiting": "대기", "swapped": "스왑됨"}[k])
                             for k in kinds])
        ax.set_ylabel(T("requests", "요청"))
        ax.set_ylim(0, len(PROMPT_LENS) + 0.5)
        ax.legend(loc="upper right", fontsize=8.5, framealpha=0.9)

        ax = axes[2, col]
        bottom = [0] * len(steps)
        labels = {"decode": T("decode", "디코드"),
                  "prefill": T("prefill of a new prompt", "새 프롬프트의 프리필"),
                  "recompute": T("prefill again after a recompute preemption",
                                 "재계산 선점 뒤 다시 하는 프리필")}
        for kind in ("decode", "prefill", "recompute"):
            vals = [r["tokens"][kind] for r in steps]
            ax.bar(x, vals, bottom=bottom, width=0.85, color=COLORS[kind], label=labels[kind])
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        ax.set_ylabel(T("tokens computed", "계산한 토큰"))
        ax.set_xlabel(T("engine step", "엔진 스텝"))
        ax.legend(loc="upper right", fontsize=8.5, framealpha=0.9)
        ax.set_xlim(-1, n_steps + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama"), seed=0, init_std=0.2)
        reference = run(tmp, "recompute", BIG_POOL)
        results = {mode: run(tmp, mode, NUM_GPU_BLOCKS) for mode in MODES}
    assert reference["stats"]["preemptions_recompute"] == 0
    same = {mode: res["tokens"] == reference["tokens"] for mode, res in results.items()}
    assert all(same.values()), f"preemption changed the tokens: {same}"
    assert results["recompute"]["stats"]["preemptions_recompute"] > 0
    assert results["swap"]["stats"]["preemptions_swap"] > 0
    out = {"config": {"model": "tiny random-weight llama (tiny_config('llama'), seed 0, "
                               "init_std 0.2)",
                      "prompt_lens": PROMPT_LENS, "output_lens": OUTPUT_LENS,
                      "block_size": BLOCK_SIZE, "num_gpu_blocks": NUM_GPU_BLOCKS,
                      "swap_space_blocks": SWAP_SPACE_BLOCKS, "max_num_seqs": 8,
                      "reference_pool_blocks": BIG_POOL},
           "same_tokens_as_without_preemption": same,
           "reference_without_preemption": {"steps": len(reference["steps"])},
           "modes": {mode: {"summary": summary(res), "steps": res["steps"]}
                     for mode, res in results.items()}}
    (HERE / "preemption.json").write_text(json.dumps(out, indent=1))
    figlang.draw_both(plot, HERE / "preemption.png", results)
    print(f"without preemption ({BIG_POOL} blocks): {len(reference['steps'])} steps")
    for mode in MODES:
        s = out["modes"][mode]["summary"]
        print(f"{mode:9} ({NUM_GPU_BLOCKS} blocks): {s['steps']} steps, preemptions by "
              f"recompute {s['preemptions_recompute']} and by swap {s['preemptions_swap']}, "
              f"swap-ins {s['swap_ins']}, blocks swapped out "
              f"{s['blocks_swapped_out']}, prefill tokens {s['prefill_tokens']} (prompts "
              f"{s['prompt_tokens']}, recomputed {s['recomputed_tokens']}), mean pool usage "
              f"{100 * s['mean_usage']:.0f} %, steps with requests both swapped and waiting "
              f"{s['steps_with_swapped_and_waiting']}")
        print(f"{'':9} preemptions (step, victim): {s['preemption_events']}")
    print(f"same tokens as without preemption: {same}")


if __name__ == "__main__":
    main()

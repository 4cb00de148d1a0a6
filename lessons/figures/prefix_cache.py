"""Prefill tokens computed per request with and without prefix caching, for requests that share
a system prompt (lesson 9's figure).

The script runs the real engine (pagedllm.reference.engine.llm.LLM) on a small random-weight Llama
checkpoint (1,024 positions) written to a temporary folder, with blocks of 16 token slots. Two
workloads, shaped like the paper's shared-prefix experiment (a translation prompt with one or
five examples in front of the sentence to translate):

- "1-shot": a shared prefix of 80 tokens (exactly 5 full blocks);
- "5-shot": a shared prefix of 341 tokens (21 full blocks and 5 tokens in a 22nd).

Each workload has 8 requests: the prefix followed by a "question" of 7 to 40 tokens of its own,
then request 8 repeats request 3 word for word (a prompt found whole in the cache). Every
request asks for 8 greedy tokens (ignore_eos). The requests run one at a time, each to its
end before the next is added, with ``enable_prefix_caching`` off and on; ``engine.stats()``
before and after each request gives its prefill tokens and prefix-cache hits, and
each request's first ``engine.step()`` is timed: its prefill (best of 3 runs; a CPU, one
thread). The requests are added with ``engine.add_request`` and stepped one call at a time; a
step observer (``engine.add_step_observer``) notes the time just before the forward, so the
prefill time counted is the forward over the uncached prompt tokens, sampling the first token
and the step's bookkeeping, up to the end of ``step()``; the JSON also has the whole ``step()``
call, scheduling and input preparation included.

It checks what the lesson claims: the same tokens with caching off and on; request 0 computes
its whole prompt; every later request reuses floor(P / 16) full blocks of the P-token prefix
and computes the rest; the repeated request reuses all of its blocks but the last (at least its
last token is always computed); and the total saved is full prefix blocks × 16 × (requests
after the first) plus what the repeat adds. It writes prefix_cache.png, its Korean edition
prefix_cache.ko.png (figlang.py) and prefix_cache.json next to itself.

    .venv/bin/python lessons/figures/prefix_cache.py     # about 15 seconds
    .venv/bin/python lessons/figures/prefix_cache.py --plot-only   # redraw from the .json
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import figlang
import torch

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 16
PREFIXES = {"1-shot": 80, "5-shot": 341}  # shared prefix lengths in the paper's experiment
QUESTION_LENS = [23, 9, 40, 17, 31, 12, 7, 26]  # each request's own tokens after the prefix
REPEAT = 3  # the last request repeats this one's prompt exactly
MAX_TOKENS = 8
REPEATS_FOR_TIMING = 3
OFF, ON, HIT = "#c53030", "#2b6cb0", "#90cdf4"


def prompts(prefix_len: int) -> list[list[int]]:
    prefix = [(31 * j + 7) % 256 for j in range(prefix_len)]
    out = [prefix + [(17 * i + 5 * j + 101) % 256 for j in range(q)]
           for i, q in enumerate(QUESTION_LENS)]
    return out + [list(out[REPEAT])]


def run(model_dir: str, prompt_ids: list[list[int]], caching: bool) -> dict:
    llm = LLM(model_dir, block_size=BLOCK_SIZE, enable_prefix_caching=caching, max_num_seqs=1)
    engine = llm.engine
    forwards = []  # (tokens the step computes, perf_counter just before the forward)
    engine.add_step_observer(lambda e, sched, inputs: forwards.append(
        (sched.num_batched_tokens, time.perf_counter())))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = []
    for i, ids in enumerate(prompt_ids):  # one request at a time: its first step is its prefill
        before = engine.stats()
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        first, out = None, None
        while out is None:
            start = time.perf_counter()
            outputs = engine.step()
            end = time.perf_counter()
            if first is None:  # the request's prefill step
                tokens, observed = forwards[-1]
                first = {"tokens": tokens, "step_seconds": end - start,
                         "forward_to_end_seconds": end - observed}
            out = next((o for o in outputs if o.finished), None)
        after = engine.stats()
        prefill = after["prefill_tokens"] - before["prefill_tokens"]
        assert first["tokens"] == prefill, "the first step computed the whole uncached prompt"
        requests.append({
            "prompt_len": len(ids),
            "prefill_tokens": prefill,
            "hit_tokens": after.get("prefix_cache_hit_tokens", 0)
            - before.get("prefix_cache_hit_tokens", 0),
            "hit_blocks": after.get("prefix_cache_hit_blocks", 0)
            - before.get("prefix_cache_hit_blocks", 0),
            "prefill_seconds": first["forward_to_end_seconds"],
            "prefill_step_seconds": first["step_seconds"],
            "tokens": out.outputs[0].token_ids,
        })
    stats = engine.stats()
    assert stats["blocks_used"] == 0, "blocks leaked"
    return {"requests": requests, "stats": stats}


def best_of(model_dir: str, prompt_ids: list[list[int]], caching: bool) -> dict:
    runs = [run(model_dir, prompt_ids, caching) for _ in range(REPEATS_FOR_TIMING)]
    best = runs[0]
    for i, r in enumerate(best["requests"]):
        assert all(o["requests"][i]["tokens"] == r["tokens"] for o in runs)
        for key in ("prefill_seconds", "prefill_step_seconds"):
            r[key] = min(o["requests"][i][key] for o in runs)
    return best


def check(name: str, prefix_len: int, off: dict, on: dict) -> dict:
    """The lesson's claims, request by request, and the formula for the total."""
    full = prefix_len // BLOCK_SIZE  # full blocks of the shared prefix
    for i, (a, b) in enumerate(zip(off["requests"], on["requests"], strict=True)):
        assert a["tokens"] == b["tokens"], f"{name}: request {i} changed with prefix caching"
        assert a["prefill_tokens"] == a["prompt_len"] and a["hit_tokens"] == 0
        if i == 0:
            expected = 0  # nothing is cached yet
        elif i == len(QUESTION_LENS):  # the repeat: all but the block of its last token
            expected = (b["prompt_len"] - 1) // BLOCK_SIZE * BLOCK_SIZE
        else:
            expected = full * BLOCK_SIZE
        assert b["hit_tokens"] == expected, (name, i, b["hit_tokens"], expected)
        assert b["prefill_tokens"] == b["prompt_len"] - expected
    n_after_first = len(QUESTION_LENS) - 1
    repeat_len = on["requests"][-1]["prompt_len"]
    formula = full * BLOCK_SIZE * n_after_first + (repeat_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    saved = on["stats"]["prefix_cache_hit_tokens"]
    assert saved == formula
    assert off["stats"]["prefill_tokens"] - on["stats"]["prefill_tokens"] == saved
    t_off = sum(r["prefill_seconds"] for r in off["requests"][1:])
    t_on = sum(r["prefill_seconds"] for r in on["requests"][1:])
    step_off = sum(r["prefill_step_seconds"] for r in off["requests"][1:])
    step_on = sum(r["prefill_step_seconds"] for r in on["requests"][1:])
    return {
        "prefix_len": prefix_len, "full_prefix_blocks": full,
        "saved_tokens_formula": (f"{full} blocks x {BLOCK_SIZE} x {n_after_first} requests + "
                                 f"{(repeat_len - 1) // BLOCK_SIZE} blocks x {BLOCK_SIZE} "
                                 "(the repeat)"),
        "saved_tokens": saved,
        "prefill_tokens_off": off["stats"]["prefill_tokens"],
        "prefill_tokens_on": on["stats"]["prefill_tokens"],
        "prefill_share_computed_on": on["stats"]["prefill_tokens"]
        / off["stats"]["prefill_tokens"],
        "hit_blocks": on["stats"]["prefix_cache_hit_blocks"],
        "blocks_cached_at_end": on["stats"]["blocks_cached"],
        "prefill_seconds_after_first_off": t_off,  # requests 1 to the end, summed
        "prefill_seconds_after_first_on": t_on,
        "prefill_speedup_after_first": t_off / t_on,
        "prefill_step_seconds_after_first_off": step_off,  # the whole step() calls
        "prefill_step_seconds_after_first_on": step_on,
        "prefill_step_speedup_after_first": step_off / step_on,
    }


def draw(results: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.6),
                             gridspec_kw={"height_ratios": [1.15, 1]})
    for col, (name, res) in enumerate(results.items()):
        off, on, s = res["off"]["requests"], res["on"]["requests"], res["summary"]
        n = len(off)
        x = range(n)
        ax = axes[0, col]
        w = 0.38
        ax.bar([i - w / 2 for i in x], [r["prefill_tokens"] for r in off], w, color=OFF,
               label=T("caching off: tokens computed", "캐싱 끔: 계산한 토큰"))
        ax.bar([i + w / 2 for i in x], [r["prefill_tokens"] for r in on], w, color=ON,
               label=T("caching on: tokens computed", "캐싱 켬: 계산한 토큰"))
        ax.bar([i + w / 2 for i in x], [r["hit_tokens"] for r in on], w,
               bottom=[r["prefill_tokens"] for r in on], color=HIT, hatch="///",
               edgecolor="white", label=T("caching on: found in the cache",
                                          "캐싱 켬: 캐시에서 찾음"))
        for i, r in enumerate(on):
            ax.text(i + w / 2, r["prefill_tokens"] + r["hit_tokens"] + 4,
                    str(r["prefill_tokens"]), ha="center", fontsize=8.5, color=ON,
                    fontweight="bold")
        rest = s["prefix_len"] % BLOCK_SIZE
        ax.axhline(s["prefix_len"], color="#555555", ls=":", lw=1.2,
                   label=T(f"shared prefix: {s['full_prefix_blocks']} blocks"
                           + (f" + {rest} tokens" if rest else ""),
                           f"공유 프리픽스: 블록 {s['full_prefix_blocks']}개"
                           + (f" + 토큰 {rest}개" if rest else "")))
        ax.set_xticks(list(x))
        ax.set_xticklabels([str(i) for i in range(n - 1)] + [f"{n - 1}\n(= {REPEAT})"])
        ax.set_xlabel(T("request (one at a time)", "요청 (한 번에 하나씩)"))
        ax.set_ylabel(T("prompt tokens", "프롬프트 토큰"))
        ax.set_ylim(0, max(r["prompt_len"] for r in off) * 1.4)
        ax.set_title(T(f"{name}: shared prefix of {s['prefix_len']} tokens, blocks of "
                       f"{BLOCK_SIZE}\n(numbers: tokens computed with caching on)",
                       f"{name}: 공유 프리픽스 {s['prefix_len']}토큰, 블록 크기 "
                       f"{BLOCK_SIZE}\n(숫자: 캐싱을 켰을 때 계산한 토큰)"), loc="left",
                     fontsize=10.5)
        ax.legend(loc="upper left", fontsize=8.5, framealpha=0.95, ncol=2)

        ax = axes[1, col]
        cum = {k: [] for k in ("off", "on", "hit")}
        for a, b in zip(off, on, strict=True):
            cum["off"].append((cum["off"] or [0])[-1] + a["prefill_tokens"])
            cum["on"].append((cum["on"] or [0])[-1] + b["prefill_tokens"])
            cum["hit"].append((cum["hit"] or [0])[-1] + b["hit_tokens"])
        ax.plot(x, cum["off"], "o-", color=OFF, label=T("prefill tokens computed, caching off",
                                                       "계산한 프리필 토큰, 캐싱 끔"))
        ax.plot(x, cum["on"], "o-", color=ON, label=T("prefill tokens computed, caching on",
                                                     "계산한 프리필 토큰, 캐싱 켬"))
        ax.plot(x, cum["hit"], "s--", color="#3182ce", mfc=HIT,
                label=T("prefix-cache hit tokens (stats)", "프리픽스 캐시 적중 토큰 (통계)"))
        on_, off_, share = (s["prefill_tokens_on"], s["prefill_tokens_off"],
                            f"{100 * s['prefill_share_computed_on']:.0f}")
        saved = f"{s['saved_tokens']} =\n{s['saved_tokens_formula']}"
        ax.set_title(T(f"caching on computes {on_} of {off_} prefill tokens ({share} %); "
                       f"saved {saved}",
                       f"캐싱을 켜면 프리필 토큰 {off_}개 중 {on_}개를 계산 ({share} %); "
                       f"아낀 토큰 {saved}"), loc="left", fontsize=10)
        ax.set_xticks(list(x))
        ax.set_xlabel(T("request", "요청"))
        ax.set_ylabel(T("tokens, cumulative", "토큰, 누적"))
        ax.set_ylim(0, cum["off"][-1] * 1.08)
        ax.legend(loc="upper left", fontsize=8.5, framealpha=0.95)
    n = len(QUESTION_LENS)
    fig.suptitle(T(f"Prefix caching on a shared prompt: {n} requests, then "
                   f"request {n} repeats request {REPEAT} exactly",
                   f"공유 프롬프트 위의 프리픽스 캐싱: 요청 {n}개, 그다음 "
                   f"요청 {n}이 요청 {REPEAT}를 그대로 되풀이"), fontsize=12.5)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def from_json(out: dict) -> dict:
    """draw()'s input again, from what prefix_cache.json keeps of the runs."""
    def requests(r: dict, mode: str) -> list[dict]:
        return [{"prompt_len": q["prompt_len"], "prefill_tokens": q[f"prefill_tokens_{mode}"],
                 "hit_tokens": q["hit_tokens"] if mode == "on" else 0} for q in r["requests"]]

    return {name: {"off": {"requests": requests(r, "off")}, "on": {"requests": requests(r, "on")},
                   "summary": r["summary"]} for name, r in out["workloads"].items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw both editions from prefix_cache.json, measuring nothing")
    if parser.parse_args(argv).plot_only:
        out = json.loads((HERE / "prefix_cache.json").read_text())
        figlang.draw_both(draw, HERE / "prefix_cache.png", from_json(out))
        return
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama", max_position_embeddings=1024),
                                seed=0, init_std=0.2)
        for name, prefix_len in PREFIXES.items():
            ids = prompts(prefix_len)
            off, on = best_of(tmp, ids, False), best_of(tmp, ids, True)
            results[name] = {"off": off, "on": on, "summary": check(name, prefix_len, off, on)}
    out = {"config": {"model": "tiny random-weight llama (tiny_config('llama', "
                               "max_position_embeddings=1024), seed 0, init_std 0.2)",
                      "block_size": BLOCK_SIZE, "prefix_lens": PREFIXES,
                      "question_lens": QUESTION_LENS, "repeat_of": REPEAT,
                      "max_tokens": MAX_TOKENS, "max_num_seqs": 1,
                      "timing": f"best of {REPEATS_FOR_TIMING} runs, CPU, 1 thread. "
                                "prefill_seconds: from the step observer (just before the "
                                "forward) to the end of the request's first engine.step(): "
                                "the forward over the uncached prompt tokens, sampling the "
                                "first token, the step's bookkeeping. prefill_step_seconds: "
                                "the whole engine.step() call, scheduling and input "
                                "preparation included"},
           "workloads": {name: {"summary": r["summary"],
                                "requests": [{"prompt_len": a["prompt_len"],
                                              "prefill_tokens_off": a["prefill_tokens"],
                                              "prefill_tokens_on": b["prefill_tokens"],
                                              "hit_tokens": b["hit_tokens"],
                                              "hit_blocks": b["hit_blocks"],
                                              "prefill_seconds_off": a["prefill_seconds"],
                                              "prefill_seconds_on": b["prefill_seconds"],
                                              "prefill_step_seconds_off":
                                              a["prefill_step_seconds"],
                                              "prefill_step_seconds_on":
                                              b["prefill_step_seconds"]}
                                             for a, b in zip(r["off"]["requests"],
                                                             r["on"]["requests"], strict=True)],
                                "same_tokens": True}
                         for name, r in results.items()}}
    (HERE / "prefix_cache.json").write_text(json.dumps(out, indent=1))
    figlang.draw_both(draw, HERE / "prefix_cache.png", results)
    for name, r in out["workloads"].items():
        s = r["summary"]
        print(f"{name}: prefix {s['prefix_len']} tokens ({s['full_prefix_blocks']} full blocks "
              f"of {BLOCK_SIZE})")
        print(f"  prompt lengths    {[q['prompt_len'] for q in r['requests']]}")
        print(f"  computed, off     {[q['prefill_tokens_off'] for q in r['requests']]}")
        print(f"  computed, on      {[q['prefill_tokens_on'] for q in r['requests']]}")
        print(f"  hit tokens        {[q['hit_tokens'] for q in r['requests']]}")
        print(f"  total {s['prefill_tokens_off']} -> {s['prefill_tokens_on']} prefill tokens "
              f"({100 * s['prefill_share_computed_on']:.1f} % computed); saved "
              f"{s['saved_tokens']} = {s['saved_tokens_formula']}")
        print(f"  prefill time of requests 1-{len(r['requests']) - 1}: off "
              f"{1e3 * s['prefill_seconds_after_first_off']:.1f} ms, on "
              f"{1e3 * s['prefill_seconds_after_first_on']:.1f} ms "
              f"({s['prefill_speedup_after_first']:.2f}x); whole step() calls: off "
              f"{1e3 * s['prefill_step_seconds_after_first_off']:.1f} ms, on "
              f"{1e3 * s['prefill_step_seconds_after_first_on']:.1f} ms "
              f"({s['prefill_step_speedup_after_first']:.2f}x)")
    print("same tokens with caching off and on: True")


if __name__ == "__main__":
    main()

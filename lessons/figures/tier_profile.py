"""Where one CPU decode step goes, in each tier (lesson 14's figure).

The script writes a small random-weight Llama checkpoint (the throughput benchmark's "full"
model: hidden 512, 8 layers, grouped-query attention with 8 query heads on 2 K/V heads, a
vocabulary of 8192; about 31M parameters in float32), and runs the same workload through both
tiers, ``pagedllm.reference.LLM`` and ``pagedllm.optimized.LLM``, with the same arguments: 16
sequences of 64 prompt tokens, prefilled in one step, then decoded greedily, one token per
sequence per step. After a few warm-up decode steps, ROUNDS rounds follow; in each round every
tier runs one step timed without any instrumentation and one step under ``torch.profiler``. The
tiers take turns so that whatever else the machine does disturbs both alike; the figure shows
each tier's least disturbed profiled step and the median of its timed steps.

Every operator's self CPU time goes into one of five groups:

- matrix products: ``aten::mm`` / ``addmm`` / ``bmm`` outside attention (the projections and
  the language-model head);
- attention: everything under the backend's ``store_kv`` and ``paged_attention`` (the K/V
  write by slot, the read of the keys and values through the block tables, the attention math);
- small ops: everything under ``rms_norm``, ``rotary`` and ``silu_and_mul``, and every other
  torch operator of the step (embedding, residual adds, views, the step inputs' tensors, the
  optimized tier's copies into its persistent buffers);
- sampling: everything under the backend's ``sample``;
- other: the step's time outside any torch operator: the scheduler, the step inputs' Python
  lists, module calls, the update and stop checks.

The backend ops are found by handing each tier a backend whose ops are wrapped in
``torch.profiler.record_function`` (the ``Backend`` seam: ``LLM(..., backend=...)``); the
labels and the grouping are ``benchmarks/step_profile.py``'s, which profiles whole workloads the
same way. To check the claim that the matrix products are bound by reading the weights, the
script also times the model's weight products alone, on 1 row and on NUM_SEQS rows.

    .venv/bin/python lessons/figures/tier_profile.py     # about 20 seconds
    .venv/bin/python lessons/figures/tier_profile.py --plot-only   # redraw from the .json

One torch thread (on a shared machine a second thread waiting for a busy core stalls every small
operator). It writes tier_profile.json, tier_profile.png and its Korean edition
tier_profile.ko.png (figlang.py) next to itself and prints a table.
The profiler adds a few microseconds to every operator it records, most of all to a tier that
dispatches many small operators, so the figure shows the timed steps too (their median, where
the profiled bar is the least disturbed of its steps). Absolute times depend on the machine;
compare the tiers side by side.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import figlang
import torch

from pagedllm.benchmarks.step_profile import GROUPS, TIERS, grouped, labeled, profile_steps
from pagedllm.reference import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2)  # benchmarks/throughput_cpu.py "full"
INIT_STD = 0.2
NUM_SEQS, PROMPT_LEN = 16, 64
BLOCK_SIZE, MAX_MODEL_LEN = 16, 256
WARMUP_STEPS, ROUNDS = 3, 12
COLORS = {"matrix products": "#2b6cb0", "attention": "#d97706", "small ops": "#6b46c1",
          "sampling": "#2f855a", "other": "#a0aec0"}
GROUPS_KO = {"matrix products": "행렬 곱", "attention": "어텐션", "small ops": "작은 연산",
             "sampling": "샘플링", "other": "기타"}
TIERS_KO = {"reference": "레퍼런스 계층", "optimized": "최적화 계층"}


class Tier:
    """One tier's engine with NUM_SEQS sequences decoding, and what its last step returned (a
    decode step touches every sequence: their tokens so far)."""

    def __init__(self, name: str, ckpt: Path):
        llm_class, backend = TIERS[name]
        self.llm = llm_class(ckpt, max_num_seqs=NUM_SEQS, block_size=BLOCK_SIZE,
                             max_model_len=MAX_MODEL_LEN,
                             num_gpu_blocks=NUM_SEQS * MAX_MODEL_LEN // BLOCK_SIZE,
                             backend=labeled(backend))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - PROMPT_LEN,
                                ignore_eos=True)
        for i in range(NUM_SEQS):
            prompt = [(7 * i + 13 * j + 1) % MODEL["vocab_size"] for j in range(PROMPT_LEN)]
            self.llm.engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        self.outputs = []
        while self.llm.stats()["prefill_tokens"] < NUM_SEQS * PROMPT_LEN:  # one step: 16 x 64
            self.step()
        for _ in range(WARMUP_STEPS):
            self.step()
        assert self.decoded() == NUM_SEQS * WARMUP_STEPS, "every sequence decodes"

    def step(self) -> None:
        self.outputs = self.llm.engine.step()

    def decoded(self) -> int:
        return self.llm.stats()["decode_tokens"]

    def tokens(self) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.outputs]


def measure(tiers: dict) -> dict:
    """ROUNDS rounds; in each, every tier runs one timed step and one profiled step, so that a
    disturbance of the machine hits both tiers alike. Per tier: the median timed step, and the
    profiled step with the smallest total (the least disturbed one)."""
    timed = {name: [] for name in tiers}
    profiled = {name: [] for name in tiers}
    for _ in range(ROUNDS):
        for name, tier in tiers.items():
            start = time.process_time()
            tier.step()
            timed[name].append((time.process_time() - start) * 1000)
            profiled[name].append(grouped(profile_steps(tier.step, 1)))
    out = {}
    for name, tier in tiers.items():
        decode_steps = WARMUP_STEPS + 2 * ROUNDS
        assert tier.decoded() == NUM_SEQS * decode_steps
        best = min(profiled[name], key=lambda r: r["profiled_step_ms"])
        context = len(tier.outputs[0].prompt_token_ids) + len(tier.outputs[0].outputs[0].token_ids)
        out[name] = {"step_ms": statistics.median(timed[name]), "timed_steps_ms": timed[name],
                     "context_at_end": context, **best,
                     "profiled_steps_ms": [r["profiled_step_ms"] for r in profiled[name]]}
    return out


def weight_products(ckpt: Path) -> dict:
    """The model's weight products alone (every nn.Linear of the reference model, the lm head
    included), best of 5, on 1 row and on NUM_SEQS rows: bound by reading the weights?"""
    from pagedllm.reference.model import load_model

    linears = [m for m in load_model(ckpt).modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    out = {"weight_bytes": nbytes}
    with torch.inference_mode():
        for rows in (1, NUM_SEQS):
            inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
            best = float("inf")
            for _ in range(5):
                start = time.process_time()
                for m in linears:
                    m(inputs[m.in_features])
                best = min(best, time.process_time() - start)
            out[f"{rows}_rows_ms"] = best * 1000
            out[f"{rows}_rows_GBps"] = nbytes / best / 1e9
    return out


def draw(result: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    tiers = list(TIERS)
    fig, (ax, ax_w) = plt.subplots(1, 2, figsize=(11, 4.4),
                                     gridspec_kw={"width_ratios": [2.2, 1]})
    for x, tier in enumerate(tiers):
        r, bottom = result["tiers"][tier], 0.0
        for g in GROUPS:
            v = r["ms_per_step"][g]
            ax.bar(x, v, bottom=bottom, color=COLORS[g], width=0.55,
                   label=T(g, GROUPS_KO[g]) if x == 0 else None)
            if v > 1.2:
                ax.text(x, bottom + v / 2, f"{v:.1f}", ha="center", va="center", color="white",
                        fontsize=9)
            bottom += v
        ax.text(x, bottom + 0.6, T(f"profiled {bottom:.1f} ms\n"
                                   f"unprofiled {r['step_ms']:.1f} ms (median)",
                                   f"프로파일링 {bottom:.1f} ms\n"
                                   f"프로파일링 없이 {r['step_ms']:.1f} ms (중앙값)"),
                ha="center", va="bottom", fontsize=9)
    top = max(result["tiers"][t]["profiled_step_ms"] for t in tiers)
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(range(len(tiers)), [T(f"{t} tier", TIERS_KO[t]) for t in tiers])
    ax.set_ylabel(T("CPU ms per decode step (torch.profiler, self time)",
                    "디코드 스텝당 CPU ms (torch.profiler, 자체 시간)"))
    ax.set_title(T(f"One decode step of {NUM_SEQS} sequences, 1 CPU thread",
                   f"시퀀스 {NUM_SEQS}개의 디코드 스텝 하나, CPU 스레드 1개"), fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    p, n = result["weight_products"], NUM_SEQS
    heights = [p["1_rows_ms"], p[f"{n}_rows_ms"], n * p["1_rows_ms"]]
    names = [T("1 row", "행 1개"), T(f"{n} rows", f"행 {n}개"),
             T(f"{n} separate\nsteps of 1 row", f"행 1개짜리\n스텝 {n}번")]
    bars = ax_w.bar(range(3), heights, color=["#2b6cb0", "#2b6cb0", "none"],
                    edgecolor="#2b6cb0", linestyle="--", width=0.6)
    bars[0].set_linestyle("-")
    bars[1].set_linestyle("-")
    for x, h in enumerate(heights):
        ax_w.text(x, h, f"{h:.1f} ms", ha="center", va="bottom", fontsize=9)
    ax_w.set_xticks(range(3), names)
    ax_w.set_ylabel(T("CPU ms, each weight product once", "CPU ms, 가중치 곱마다 한 번"))
    mb, gbps = f"{p['weight_bytes'] / 1e6:.0f}", f"{p['1_rows_GBps']:.0f}"
    ax_w.set_title(T(f"The weight products alone\n({mb} MB; 1 row reads them at {gbps} GB/s)",
                     f"가중치 곱만\n({mb} MB; 행 1개는 {gbps} GB/s로 읽음)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw both editions from tier_profile.json, measuring nothing")
    if parser.parse_args(argv).plot_only:
        result = json.loads((HERE / "tier_profile.json").read_text())
        figlang.draw_both(draw, HERE / "tier_profile.png", result)
        return result
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config("llama", max_position_embeddings=MAX_MODEL_LEN, **MODEL)
        ckpt = write_random_checkpoint(Path(tmp) / "llama", cfg, seed=0, init_std=INIT_STD)
        engines = {name: Tier(name, ckpt) for name in TIERS}
        tiers = measure(engines)
        tokens = {name: tier.tokens() for name, tier in engines.items()}
        del engines
        products = weight_products(ckpt)
    same = tokens["reference"] == tokens["optimized"]
    result = {"model": MODEL, "num_seqs": NUM_SEQS, "prompt_len": PROMPT_LEN,
              "block_size": BLOCK_SIZE, "warmup_steps": WARMUP_STEPS, "rounds": ROUNDS,
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "same_tokens": same, "weight_products": products, "tiers": tiers}
    print(f"{NUM_SEQS} sequences decoding, context ~{tiers['reference']['context_at_end']} "
          f"tokens, 1 thread; same tokens in both tiers: {same}")
    print(f"{'ms per step':24}" + "".join(f"{t:>12}" for t in TIERS))
    for g in GROUPS:
        print(f"  {g:22}" + "".join(f"{tiers[t]['ms_per_step'][g]:12.2f}" for t in TIERS))
    print(f"  {'profiled step':22}" + "".join(f"{tiers[t]['profiled_step_ms']:12.2f}"
                                              for t in TIERS))
    print(f"  {'unprofiled step':22}" + "".join(f"{tiers[t]['step_ms']:12.2f}" for t in TIERS))
    print(f"  {'operator calls':22}" + "".join(f"{tiers[t]['operator_calls_per_step']:12d}"
                                               for t in TIERS))
    print(f"  {'matrix product calls':22}" + "".join(
        f"{tiers[t]['matrix_product_calls']:12d}" for t in TIERS))
    print(f"  {'outermost calls':22}" + "".join(
        f"{tiers[t]['outermost_operator_calls_per_step']:12d}" for t in TIERS))
    p = products
    print(f"weight products alone ({p['weight_bytes'] / 1e6:.0f} MB of weights): 1 row "
          f"{p['1_rows_ms']:.1f} ms ({p['1_rows_GBps']:.1f} GB/s), {NUM_SEQS} rows "
          f"{p[f'{NUM_SEQS}_rows_ms']:.1f} ms")
    assert same, "the tiers disagree on greedy tokens"
    (HERE / "tier_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    figlang.draw_both(draw, HERE / "tier_profile.png", result)
    return result


if __name__ == "__main__":
    main()

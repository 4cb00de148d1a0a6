"""One engine step's inputs, as the model sees them (lesson 4's figure "The step's inputs").

The script runs the real engine (pagedllm.reference.engine.llm.LLM) on a small random-weight
Llama checkpoint written to a temporary folder, with chunked prefill on, a token budget of 16
per step and blocks of 4 token slots. Five requests are queued before the first step:

    A  4-token prompt, greedy          B  6-token prompt, greedy
    C  14-token prompt, greedy         D  3-token prompt, n = 2 samples (temperature 0.8, seed 7)
    E  7-token prompt, greedy

Step 0 prefills A and B whole and the first 6 tokens of C (4 + 6 + 6 = 16). Step 1, the one
this figure shows, mixes every kind of work a step can hold: A and B decode one token each, C
computes its last 8 prompt tokens (a chunk that reaches the end of the prompt), D is admitted
and prefilled whole, and E is admitted with the 3 tokens the budget still allows (a first chunk).

A step observer (``engine.add_step_observer``), which the engine calls in every step just
before the forward, receives the step's ``StepInputs`` (``prepare_inputs``); the script keeps
them all and draws step 1:

- top: the flat batch, one column per token row, with its input_ids, positions and
  slot_mapping, grouped by sequence (query_start_loc gives the boundaries), and the rows that
  logits_indices picks for sampling (D's last row twice: its prompt feeds both samples);
- bottom left: block_tables (one row per sequence, zero-padded) and seq_lens;
- bottom right: the physical pool, each slot coloured by the sequence that holds it: the slots
  this step writes (slot_mapping) dark with their position, the slots written by earlier steps
  light.

It checks that step 1 mixes decodes, a last chunk, a whole prompt and a first chunk, what the
lesson says about every step's inputs (every slot is block_table[p // 4] * 4 + p % 4, every
sampled row is the last row of its sequence, seq_lens are the last position + 1), and that every
request's tokens equal its tokens when it runs alone. It writes step_inputs.png, its Korean
edition step_inputs.ko.png (figlang.py) and step_inputs.json next to itself.

    .venv/bin/python lessons/figures/step_inputs.py     # a few seconds
"""

import argparse
import json
import tempfile
from pathlib import Path

import figlang
import torch

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

HERE = Path(__file__).resolve().parent
BLOCK_SIZE, NUM_GPU_BLOCKS, BUDGET = 4, 16, 16
MAX_TOKENS = 4
REQUESTS = {  # request id -> (prompt length, sampling parameters)
    "A": (4, dict(temperature=0)),
    "B": (6, dict(temperature=0)),
    "C": (14, dict(temperature=0)),
    "D": (3, dict(n=2, temperature=0.8, seed=7)),
    "E": (7, dict(temperature=0)),
}
SHOWN_STEP = 1  # the step drawn (and checked for a mix of every kind of work)
COLORS = {"A": "#2b6cb0", "B": "#d97706", "C": "#2f855a", "D": "#b83280", "E": "#6b46c1"}
LIGHT = {"A": "#bfd4ee", "B": "#f6d7ae", "C": "#bfe0cb", "D": "#ecc3dd", "E": "#d6cbef"}


def prompt(i: int, n: int) -> list[int]:
    return [(37 * i + 11 * j + 5) % 256 for j in range(n)]


def params(kwargs: dict) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def make_llm(model_dir: str) -> LLM:
    return LLM(model_dir, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=8,
               enable_chunked_prefill=True, max_num_batched_tokens=BUDGET)


def kind(item) -> str:
    """What a scheduled sequence computes this step, read before the step runs."""
    seq = item.seq
    if not seq.is_prefill:
        return "decode"
    whole = seq.num_computed_tokens == 0 and item.num_tokens == len(seq)
    if whole:
        return "prefill (whole prompt)"
    if item.samples:
        return "last chunk"
    return "first chunk" if seq.num_computed_tokens == 0 else "middle chunk"


def capture(engine, sched, inputs) -> dict:
    """The step's inputs as plain lists, and who each sequence of the batch is."""
    md = inputs.attn_metadata
    starts = md.query_start_loc_cpu.tolist()
    seqs = []
    for b, item in enumerate(sched.scheduled):
        seq = item.seq
        seqs.append({
            "request_id": item.group.request_id, "seq_id": seq.seq_id, "kind": kind(item),
            "rows": [starts[b], starts[b + 1]], "num_tokens": item.num_tokens,
            "prompt_len": len(seq.prompt_token_ids), "computed_before": seq.num_computed_tokens,
            "samples": item.samples, "blocks_held": len(engine.kv.get_block_ids(seq)[0]),
            "sampled_rows": sum(row.item is item for row in inputs.rows),
        })
    sampling = inputs.sampling
    return {
        "sequences": seqs,
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": md.slot_mapping.tolist(),
        "block_tables": md.block_tables.tolist(),
        "seq_lens": md.seq_lens.tolist(),
        "query_start_loc": md.query_start_loc.tolist(),
        "logits_indices": inputs.logits_indices.tolist(),
        "sampling_rows": [{"request_id": r.item.group.request_id, "sample_index": r.sample_index}
                          for r in inputs.rows],
        "sampling": {"temperature": [round(t, 4) for t in sampling.temperature.tolist()],
                     "streams": sampling.streams.tolist(),
                     "positions": sampling.positions.tolist()},
        "blocks_used": engine.stats()["blocks_used"],
    }


def run(model_dir: str) -> dict:
    llm = make_llm(model_dir)
    engine = llm.engine
    for i, (name, (n, kwargs)) in enumerate(REQUESTS.items()):
        engine.add_request(name, {"prompt_token_ids": prompt(i, n)}, params(kwargs))
    steps = []
    engine.add_step_observer(lambda e, sched, inputs: steps.append(capture(e, sched, inputs)))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
    assert engine.stats()["blocks_used"] == 0, "blocks leaked"
    return {"steps": steps, "tokens": tokens}


def alone(model_dir: str) -> dict:
    """Each request in an engine of its own: the tokens the batch must reproduce."""
    out = {}
    for i, (name, (n, kwargs)) in enumerate(REQUESTS.items()):
        result = make_llm(model_dir).generate({"prompt_token_ids": prompt(i, n)},
                                              params(kwargs), use_tqdm=False)[0]
        out[name] = [c.token_ids for c in result.outputs]
    return out


MIX = {"decode", "last chunk", "prefill (whole prompt)", "first chunk"}


def check(step: dict) -> None:
    """What lesson 4 says about a step's inputs."""
    assert len(step["input_ids"]) == len(step["positions"]) == len(step["slot_mapping"])
    assert step["query_start_loc"][-1] == len(step["input_ids"]) <= BUDGET
    picked = []
    for b, s in enumerate(step["sequences"]):
        lo, hi = s["rows"]
        assert (lo, hi) == tuple(step["query_start_loc"][b:b + 2])
        table = step["block_tables"][b]
        for r in range(lo, hi):
            p = step["positions"][r]
            assert step["slot_mapping"][r] == table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        assert step["positions"][lo:hi] == list(range(s["computed_before"],
                                                      s["computed_before"] + hi - lo))
        assert step["seq_lens"][b] == step["positions"][hi - 1] + 1
        assert s["samples"] == (s["sampled_rows"] > 0)
        picked += [hi - 1] * s["sampled_rows"]
    assert step["logits_indices"] == picked
    assert len(step["sampling"]["streams"]) == len(step["logits_indices"])


def draw(step: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    tr = figlang.chooser(lang)  # (T is the batch's token rows, as in the lesson)
    chunk_ko = {"first chunk": "첫 청크", "middle chunk": "중간 청크", "last chunk": "마지막 청크"}
    seqs = step["sequences"]
    T = len(step["input_ids"])
    owner = {}  # row -> request id
    for s in seqs:
        for r in range(*s["rows"]):
            owner[r] = s["request_id"]

    fig = plt.figure(figsize=(14, 10.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.15, 1], width_ratios=[0.9, 1.25],
                            hspace=0.18, wspace=0.08)

    # Top: the flat batch.
    ax = fig.add_subplot(grid[0, :])
    w, h = 1.0, 0.8
    fields = [("input_ids", step["input_ids"]), ("positions", step["positions"]),
              ("slot_mapping", step["slot_mapping"])]
    for k, (name, values) in enumerate(fields):
        y = -k
        ax.text(-0.3, y + h / 2, name, ha="right", va="center", fontsize=11, family="monospace")
        for r, v in enumerate(values):
            req = owner[r]
            ax.add_patch(Rectangle((r * w, y), w, h, facecolor=LIGHT[req], edgecolor="white",
                                   lw=1.2))
            ax.text(r * w + w / 2, y + h / 2, str(v), ha="center", va="center", fontsize=10.5,
                    color="black")
    for r in range(T):  # row numbers
        ax.text(r * w + w / 2, 1.05, str(r), ha="center", va="bottom", fontsize=9,
                color="#555555")
    ax.text(-0.3, 1.05, tr("row", "행"), ha="right", va="bottom", fontsize=10, color="#555555",
            family="monospace" if lang == "en" else None)  # a monospace font has no Hangul
    for s in seqs:  # one bracket and label per sequence
        lo, hi = s["rows"]
        req = s["request_id"]
        ax.plot([lo * w + 0.08, hi * w - 0.08], [1.62, 1.62], color=COLORS[req], lw=3,
                solid_capstyle="butt")
        what, start = s["kind"], s["computed_before"]
        end = start + s["num_tokens"] - 1
        samples = s["sampled_rows"]
        if what == "decode":
            detail = tr(f"decode\npos {start}", f"디코드\n위치 {start}")
        elif what == "prefill (whole prompt)":
            detail = tr(f"whole prompt\n{s['num_tokens']} tokens",
                        f"프롬프트 전체\n토큰 {s['num_tokens']}개") + (
                f", n = {samples}" if samples > 1 else "")
        else:
            detail = tr(f"{what}\npositions {start}-{end} of {s['prompt_len']}",
                        f"{chunk_ko.get(what, what)}\n{s['prompt_len']}개 중 위치 {start}-{end}")
        ax.text((lo + hi) * w / 2, 1.75, f"{req}\n{detail}", ha="center", va="bottom",
                fontsize=9.5 if hi - lo > 1 else 8.5, color=COLORS[req], fontweight="bold",
                linespacing=1.2)
    qsl = step["query_start_loc"]
    for b, x in enumerate(qsl):  # sequence boundaries
        ax.plot([x * w, x * w], [-2.15, 1.55], color="black", lw=1.4 if b in (0, len(qsl) - 1)
                else 1.1, ls="-" if b in (0, len(qsl) - 1) else "--")
        ax.text(x * w, -2.3, str(x), ha="center", va="top", fontsize=10.5, fontweight="bold")
    ax.text(-0.3, -2.3, "query_start_loc", ha="right", va="top", fontsize=11,
            family="monospace")
    counts = {}
    for r in step["logits_indices"]:
        counts[r] = counts.get(r, 0) + 1
    for r, c in counts.items():
        ax.annotate("", xy=(r * w + w / 2, -2.05), xytext=(r * w + w / 2, -3.05),
                    arrowprops={"arrowstyle": "-|>", "color": COLORS[owner[r]], "lw": 2})
        ax.text(r * w + w / 2, -3.15, tr(f"row {r}", f"행 {r}") + (f"\n× {c}" if c > 1 else ""),
                ha="center", va="top", fontsize=10, color=COLORS[owner[r]], fontweight="bold")
    ax.text(-0.3, -3.15, "logits_indices", ha="right", va="top", fontsize=11,
            family="monospace")
    ax.text(T * w + 0.3, -3.15, f"= {step['logits_indices']}", ha="left", va="top",
            fontsize=10.5, family="monospace")
    ax.set_xlim(-3.2, T * w + 4.2)
    ax.set_ylim(-4.2, 3.3)
    ax.axis("off")
    ax.set_title(tr(f"Step {SHOWN_STEP}: one flat batch of T = {T} token rows from "
                    f"{len(seqs)} sequences (token budget {BUDGET}); the model runs once on all "
                    "of them",
                    f"스텝 {SHOWN_STEP}: 시퀀스 {len(seqs)}개의 토큰 행 T = {T}개로 된 평평한 "
                    f"배치 하나 (토큰 예산 {BUDGET}); 모델은 이 모두에 대해 한 번 실행된다"),
                 fontsize=12.5, loc="left")

    # Bottom left: block tables and sequence lengths.
    ax = fig.add_subplot(grid[1, 0])
    tables = step["block_tables"]
    width = len(tables[0])
    for b, (s, row) in enumerate(zip(seqs, tables, strict=True)):
        req = s["request_id"]
        y = -b
        ax.text(-0.25, y + 0.4, tr(f"{req}  (seq {s['seq_id']})", f"{req}  (시퀀스 {s['seq_id']})"),
                ha="right", va="center",
                fontsize=10.5, color=COLORS[req], fontweight="bold")
        for j, block in enumerate(row):
            real = j < s["blocks_held"]  # past it: padding
            ax.add_patch(Rectangle((j, y), 1, 0.8, facecolor=LIGHT[req] if real else "#f2f2f2",
                                   edgecolor="white", lw=1.2))
            ax.text(j + 0.5, y + 0.4, str(block), ha="center", va="center", fontsize=11,
                    color="black" if real else "#aaaaaa")
        ax.text(width + 0.9, y + 0.4, str(step["seq_lens"][b]), ha="center", va="center",
                fontsize=11, fontweight="bold")
    ax.text(width / 2, 1.0, "block_tables", ha="center", va="bottom", fontsize=11,
            family="monospace")
    ax.text(width + 0.9, 1.0, "seq_lens", ha="center", va="bottom", fontsize=11,
            family="monospace")
    ax.text(-2.4, -len(seqs) - 0.1, tr(
        "grey: padding (0), never read: attention reads\n"
        f"ceil(seq_len / {BLOCK_SIZE}) entries of a row. seq_lens: tokens\n"
        "in the cache once this step's K/V are stored.",
        "회색: 패딩 (0), 읽히지 않음: 어텐션은 행마다\n"
        f"ceil(seq_len / {BLOCK_SIZE})개 항목만 읽는다. seq_lens: 이 스텝의\n"
        "K/V를 저장한 뒤 캐시에 있는 토큰 수."), ha="left", va="top",
            fontsize=9.5, color="#444444")
    ax.set_xlim(-2.6, width + 2)
    ax.set_ylim(-len(seqs) - 1.5, 1.6)
    ax.axis("off")

    # Bottom right: the physical pool.
    ax = fig.add_subplot(grid[1, 1])
    written = {slot: r for r, slot in enumerate(step["slot_mapping"])}
    holder, pos_of = {}, {}
    for b, s in enumerate(seqs):
        table = step["block_tables"][b][:s["blocks_held"]]
        for p in range(step["seq_lens"][b]):
            slot = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            holder[slot], pos_of[slot] = s["request_id"], p
        for block in table:
            for off in range(BLOCK_SIZE):
                holder.setdefault(block * BLOCK_SIZE + off, s["request_id"])
    per_row = 4
    n_blocks = max(max(t[:s["blocks_held"]]) for s, t in zip(seqs, step["block_tables"],
                                                              strict=True)) + 2
    for block in range(n_blocks):
        bx, by = (block % per_row) * (BLOCK_SIZE + 0.6), -(block // per_row) * 1.45
        for off in range(BLOCK_SIZE):
            slot = block * BLOCK_SIZE + off
            x = bx + off
            req = holder.get(slot)
            if slot in written:
                face, text, color = COLORS[req], str(pos_of[slot]), "white"
            elif slot in pos_of:
                face, text, color = LIGHT[req], str(pos_of[slot]), "#333333"
            else:
                face, text, color = "white", "", "black"
            ax.add_patch(Rectangle((x, by), 1, 0.8, facecolor=face, edgecolor="#cccccc"
                                   if req is None else COLORS[req], lw=0.6,
                                   hatch="////" if req is not None and slot not in pos_of
                                   else None))
            ax.text(x + 0.5, by + 0.4, text, ha="center", va="center", fontsize=10,
                    color=color, fontweight="bold" if slot in written else "normal")
            ax.text(x + 0.5, by - 0.02, str(slot), ha="center", va="top", fontsize=7,
                    color="#888888")
        ax.text(bx + BLOCK_SIZE / 2, by + 0.88, tr(f"block {block}", f"블록 {block}"),
                ha="center", va="bottom",
                fontsize=9.5, color="black" if any(block * BLOCK_SIZE + o in holder
                                                  for o in range(BLOCK_SIZE)) else "#999999")
    rows = -(-n_blocks // per_row)
    ax.text(0, -(rows - 1) * 1.45 - 0.55,
            tr("dark: written this step, at slot_mapping (numbers: token positions; small: "
               "slot ids)\nlight: K/V stored by earlier steps     hatched: allocated, not yet "
               "written",
               "진한 색: 이 스텝에 slot_mapping 자리에 쓴 것 (숫자: 토큰 위치; 작은 숫자: 슬롯 "
               "번호)\n연한 색: 이전 스텝들이 저장한 K/V     빗금: 할당되었지만 아직 쓰지 않음"),
            ha="left", va="top", fontsize=9.5, color="#444444")
    ax.set_xlim(-0.3, per_row * (BLOCK_SIZE + 0.6))
    ax.set_ylim(-(rows - 1) * 1.45 - 1.5, 1.4)
    ax.axis("off")
    ax.set_title(tr(f"the KV pool (blocks of {BLOCK_SIZE} slots), as the step's store_kv "
                    "leaves it",
                    f"스텝의 store_kv가 마친 뒤의 KV 풀 (슬롯 {BLOCK_SIZE}개짜리 블록)"),
                 fontsize=11.5, loc="left")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "step_inputs.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, tiny_config("llama"), seed=0, init_std=0.2)
        result = run(tmp)
        single = alone(tmp)
    assert result["tokens"] == single, "batching changed a request's tokens"
    kinds = {s["kind"] for s in result["steps"][1]["sequences"]}
    assert MIX <= kinds, f"step 1 no longer mixes every kind of work: it holds only {kinds}"
    for step in result["steps"]:
        check(step)
    step = result["steps"][SHOWN_STEP]
    out = {"config": {"model": "tiny random-weight llama (tiny_config('llama'), seed 0, "
                               "init_std 0.2)",
                      "block_size": BLOCK_SIZE, "num_gpu_blocks": NUM_GPU_BLOCKS,
                      "enable_chunked_prefill": True, "max_num_batched_tokens": BUDGET,
                      "max_tokens": MAX_TOKENS, "ignore_eos": True,
                      "requests": {name: {"prompt_len": n, **kw}
                                   for name, (n, kw) in REQUESTS.items()}},
           "shown_step": SHOWN_STEP, "step": step,
           "steps": [{"step": i, "sequences": [[s["request_id"], s["kind"], s["num_tokens"]]
                                               for s in st["sequences"]],
                      "tokens": len(st["input_ids"])} for i, st in enumerate(result["steps"])],
           "tokens": result["tokens"], "same_tokens_as_alone": True}
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(out, indent=1))
    figlang.draw_both(draw, args.out, step)
    print(f"step {SHOWN_STEP}: " + ", ".join(f"{s['request_id']} {s['kind']} "
                                             f"({s['num_tokens']})" for s in step["sequences"]))
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "logits_indices"):
        print(f"  {name:16} {step[name]}")
    print(f"  sampling streams {step['sampling']['streams']}, positions "
          f"{step['sampling']['positions']}, temperature {step['sampling']['temperature']}")
    print("steps: " + "; ".join(f"{s['step']}: {s['tokens']} tokens" for s in out["steps"]))
    print(f"every request's tokens equal its tokens alone: {out['same_tokens_as_alone']}")
    print(f"wrote {args.out}, {figlang.edition(args.out, 'ko')} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

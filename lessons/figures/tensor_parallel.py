"""What each rank holds of a decoder layer, and what splitting buys seed 003's 400B model
(lesson 19's figure).

Left: the tiny model (``pagedllm/models/tiny-pydoc``: 8 query heads over 2 KV heads, hidden 256,
MLP 704, vocabulary 4,096) on 2 ranks, as ``narrow_model`` in ``reference/model/tensor_parallel.py``
cuts it: for every weight, which part of the saved tensor each rank reads (output rows for the
column-parallel layers and the vocabulary, input columns for the row-parallel ones), and what the
layer sends between ranks afterwards (``parallelize``: an all-reduce after o_proj, after
down_proj and after the embedding, a gather of the logits to rank 0 after the LM head).

Right: Llama-3.1-405B (126 layers, 8 KV heads of 128) on GPUs of 80 GiB at 90 % use, as the
planner (``reference/deployment.py``) counts it for each ``tensor_parallel_size``: how many
sequences of 16,384 tokens fit at once in what the weights leave, per weight precision. Past 8
GPUs each KV head is replicated, so a token's KV bytes per GPU stop shrinking; only the weights'
share keeps falling.

    .venv/bin/python lessons/figures/tensor_parallel.py    # a few seconds

It writes tensor_parallel.json, tensor_parallel.png and its Korean edition tensor_parallel.ko.png
(figlang.py) next to itself and prints both tables.
"""

import json
from pathlib import Path

import figlang
import torch

from pagedllm.reference.deployment import deployment
from pagedllm.reference.kv_size import GIB, kv_size
from pagedllm.reference.model.config import load_config
from pagedllm.reference.model.loader import ARCHITECTURES
from pagedllm.reference.model.tensor_parallel import attention_heads, narrow_model, shard_range

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "pagedllm" / "models" / "tiny-pydoc"
RANKS = 2
BIG, CONTEXT, GPU_GIB = "llama-3.1-405b", 16384, 80
SIZES = (1, 2, 4, 8, 16)
SCHEMES = (("bf16", None), ("fp8", "fp8"), ("int4, groups of 64", "int4"))
RANK_COLORS = ("#2b6cb0", "#dd6b20")
SCHEME_COLORS = {"bf16": "#718096", "fp8": "#2b6cb0", "int4, groups of 64": "#2f855a"}

# The layer's weights in the order a token's activations meet them, with the communication
# parallelize() puts after each one (None: the next product starts from the rank's own part).
ROWS = (("embed_tokens", "model.embed_tokens.weight", "all-reduce [T, hidden]"),
        ("q_proj", "model.layers.0.self_attn.q_proj.weight", None),
        ("k_proj", "model.layers.0.self_attn.k_proj.weight", None),
        ("v_proj", "model.layers.0.self_attn.v_proj.weight", None),
        ("o_proj", "model.layers.0.self_attn.o_proj.weight", "all-reduce [T, hidden]"),
        ("gate_proj", "model.layers.0.mlp.gate_proj.weight", None),
        ("up_proj", "model.layers.0.mlp.up_proj.weight", None),
        ("down_proj", "model.layers.0.mlp.down_proj.weight", "all-reduce [T, hidden]"),
        ("lm_head", "lm_head.weight", "gather [S, vocab] to rank 0"))


def layer_split() -> dict:
    """Each rank's slice of every weight of the tiny model's layer 0, from narrow_model."""
    cfg = load_config(TINY)
    with torch.device("meta"):
        full = ARCHITECTURES[cfg.model_type](cfg).state_dict()
    per_rank = []
    for rank in range(RANKS):
        with torch.device("meta"):
            model = ARCHITECTURES[cfg.model_type](cfg)
        per_rank.append(narrow_model(model, rank, RANKS))
    rows = []
    for label, name, comm in ROWS:
        dims = [s[name][0] for s in per_rank]
        assert len(set(dims)) == 1, name  # every rank cuts the same dimension
        dim = dims[0]
        split = "input columns" if dim else "output rows"
        if label in ("embed_tokens", "lm_head"):
            split = "vocabulary rows"
        rows.append({"weight": label, "shape": list(full[name].shape), "dim": dim,
                     "split": split,
                     "ranks": [list(s[name][1:]) for s in per_rank], "communication": comm})
    heads = [attention_heads(cfg, r, RANKS) for r in range(RANKS)]
    return {"model": "tiny-pydoc", "ranks": RANKS, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "layers": cfg.num_layers,
            "query_heads": [[h[0].start, h[0].stop] for h in heads],
            "kv_heads": [[h[1].start, h[1].stop] for h in heads],
            "mlp_units": [list(shard_range(cfg.intermediate_size, r, RANKS))
                          for r in range(RANKS)],
            "rows": rows}


def planner() -> list[dict]:
    """The planner's answer for the 405B model per tensor_parallel_size and precision."""
    kv = kv_size(BIG, "bfloat16")
    out = []
    for label, scheme in SCHEMES:
        for n in SIZES:
            d = deployment(kv, GPU_GIB, n, scheme, group_size=64)
            out.append({"weights": label, "tensor_parallel_size": n,
                        "weight_gib_per_gpu": round(d.weight_bytes_per_gpu / GIB, 2),
                        "kv_gib_per_gpu": round(max(d.kv_bytes_per_gpu, 0) / GIB, 2),
                        "kv_heads_per_gpu": d.kv_heads_per_gpu,
                        "kv_bytes_per_token_per_gpu": d.kv_bytes_per_token_per_gpu,
                        "tokens": d.tokens, "sequences": d.sequences(CONTEXT),
                        "fits": d.kv_bytes_per_gpu > 0})
    return out


def draw(split: dict, plan: list[dict], path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    ko_words = {"vocabulary rows": "어휘 행", "output rows": "출력 행",
                "input columns": "입력 열", "groups of 64": "그룹 64",
                "gather [S, vocab] to rank 0": "랭크 0으로 gather [S, vocab]"}

    def words(text: str) -> str:  # the Korean edition's words in the data's labels
        if lang == "ko":
            for en, ko in ko_words.items():
                text = text.replace(en, ko)
        return text

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.5, 4.8),
                                 gridspec_kw={"width_ratios": [1.35, 1]})
    rows = split["rows"]
    y = list(range(len(rows)))[::-1]
    for yi, row in zip(y, rows, strict=True):
        size = row["shape"][row["dim"]]
        for rank, (start, end) in enumerate(row["ranks"]):
            ax.barh(yi, (end - start) / size, left=start / size, height=0.6,
                    color=RANK_COLORS[rank], edgecolor="white")
            ax.text((start + end) / 2 / size, yi, f"{start}–{end - 1}", ha="center",
                    va="center", color="white", fontsize=7.5)
        shape = f"{row['weight']} {row['shape'][0]}×{row['shape'][1]}"
        ax.text(-0.02, yi, T(f"{shape}\nby {row['split']}", f"{shape}\n{words(row['split'])} 분할"),
                ha="right", va="center", fontsize=8)
        comm = words(row["communication"]) if row["communication"] else T("nothing sent",
                                                                            "보내는 것 없음")
        ax.text(1.03, yi, comm, ha="left", va="center", fontsize=8,
                color="#c53030" if row["communication"] else "#718096",
                fontweight="bold" if row["communication"] else "normal")
    ax.set_xlim(-0.42, 1.5)  # room for the labels on the left, the communication on the right
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks([])
    ax.set_xticks([])
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    qh, kvh = split["query_heads"], split["kv_heads"]
    q0, q1 = f"{qh[0][0]}–{qh[0][1] - 1}", f"{qh[1][0]}–{qh[1][1] - 1}"
    ax.set_title(T(f"One layer of {split['model']} on {split['ranks']} ranks (rank 0 blue, "
                   f"rank 1 orange)\nrank 0: query heads {q0}, KV head {kvh[0][0]}; "
                   f"rank 1: query heads {q1}, KV head {kvh[1][0]}",
                   f"랭크 {split['ranks']}개에 나눈 {split['model']}의 레이어 하나 (랭크 0 파랑, "
                   f"랭크 1 주황)\n랭크 0: 쿼리 헤드 {q0}, KV 헤드 {kvh[0][0]}; "
                   f"랭크 1: 쿼리 헤드 {q1}, KV 헤드 {kvh[1][0]}"), fontsize=9.5)

    width = 0.26
    for i, (label, _) in enumerate(SCHEMES):
        mine = [r for r in plan if r["weights"] == label]
        xs = [j + (i - 1) * width for j in range(len(SIZES))]
        bars = bx.bar(xs, [r["sequences"] for r in mine], width, color=SCHEME_COLORS[label],
                      label=words(label))
        for x, r, bar in zip(xs, mine, bars, strict=True):
            text = f"{r['sequences']}" if r["fits"] else T("no", "불가")
            bx.text(x, bar.get_height() + 1, text, ha="center", va="bottom", fontsize=7.5)
    heads = {r["tensor_parallel_size"]: r["kv_heads_per_gpu"] for r in plan}
    bx.set_xticks(range(len(SIZES)),
                  [T(f"{n}\n{heads[n]} KV head{'s' if heads[n] > 1 else ''}",
                     f"{n}\nKV 헤드 {heads[n]}개") for n in SIZES],
                  fontsize=8)
    bx.axvline(3.5, color="#a0aec0", ls="--", lw=1)
    bx.text(3.45, bx.get_ylim()[1] * 0.97,
            T("more GPUs than KV heads:\neach head replicated \u2192",
              "GPU가 KV 헤드보다 많음:\n헤드마다 복제 \u2192"),
            fontsize=7.5, ha="right", va="top", color="#4a5568")
    bx.set_xlabel(T("tensor_parallel_size (GPUs), and KV heads each GPU keeps",
                    "tensor_parallel_size (GPU 수)와 GPU마다 두는 KV 헤드"), fontsize=9)
    bx.set_ylabel(T(f"sequences of {CONTEXT:,} tokens that fit",
                    f"들어가는 {CONTEXT:,}토큰 시퀀스 수"), fontsize=9)
    bx.set_title(T(f"Llama-3.1-405B on {GPU_GIB} GiB GPUs, 90 % used (the planner)\n"
                   "'no': the weights alone do not fit",
                   f"{GPU_GIB} GiB GPU의 Llama-3.1-405B, 90 % 사용 (플래너)\n"
                   "'불가': 가중치만으로도 들어가지 않음"), fontsize=9.5)
    bx.legend(fontsize=8, loc="upper left")
    bx.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    split, plan = layer_split(), planner()
    (HERE / "tensor_parallel.json").write_text(
        json.dumps({"layer_split": split, "planner": plan}, indent=1) + "\n")
    figlang.draw_both(draw, HERE / "tensor_parallel.png", split, plan)
    print(f"{split['model']} on {split['ranks']} ranks:")
    for row in split["rows"]:
        print(f"  {row['weight']:13} {str(row['shape']):12} by {row['split']:13} "
              f"{row['ranks']}  then {row['communication'] or 'nothing'}")
    print(f"\n{BIG}, {GPU_GIB} GiB GPUs, sequences of {CONTEXT:,} tokens:")
    for r in plan:
        print(f"  {r['weights']:19} N={r['tensor_parallel_size']:2}  weights "
              f"{r['weight_gib_per_gpu']:6.1f} GiB/GPU  KV {r['kv_gib_per_gpu']:5.1f} GiB/GPU  "
              f"{r['kv_bytes_per_token_per_gpu']:>7,} B/token/GPU  tokens {r['tokens']:>9,}  "
              f"sequences {r['sequences']}")


if __name__ == "__main__":
    main()

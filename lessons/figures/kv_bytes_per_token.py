"""KV-cache bytes per token under MHA, GQA, MQA and MLA, for real model shapes (lesson 12's figure).

- Llama-2-7B (MHA), Mistral-7B and Llama-3-8B (GQA, 8 K/V heads): the presets of
  ``reference/kv_size.py``, fp16/bf16: 2 (K and V) x layers x kv_heads x head_dim x 2 bytes.
- Llama-3-8B's shapes with a single K/V head: what multi-query attention would store (no
  released model; for scale).
- DeepSeek-V2 (MLA), from its published dimensions: 60 layers, each caching one latent vector of
  kv_lora_rank = 512 plus one decoupled rotary key of 64, shared by all 128 heads:
  60 x (512 + 64) x 2 bytes. Computed here, not a preset of the calculator.
- For comparison, the full per-head K/V that DeepSeek-V2's 128 heads would cache without the
  latent (keys of 128 + 64 = 192, values of 128): 60 x 128 x (192 + 128) x 2 bytes.

    .venv/bin/python lessons/figures/kv_bytes_per_token.py    # under a second

It writes kv_bytes_per_token.json, kv_bytes_per_token.png and its Korean edition
kv_bytes_per_token.ko.png (figlang.py) next to itself and prints a table.
"""

import json
from pathlib import Path

import figlang

from pagedllm.reference.kv_size import GIB, kv_size

HERE = Path(__file__).resolve().parent
BYTES = 2  # fp16 / bf16
# DeepSeek-V2's published attention dimensions
DSV2_LAYERS, DSV2_HEADS = 60, 128
DSV2_KV_LORA_RANK, DSV2_ROPE_DIM = 512, 64
DSV2_NOPE_DIM, DSV2_V_DIM = 128, 128


def rows() -> list[dict]:
    out = []
    for preset, label, kind in (("llama-2-7b", "Llama-2-7B", "MHA"),
                                ("mistral-7b", "Mistral-7B", "GQA"),
                                ("llama-3-8b", "Llama-3-8B", "GQA")):
        s = kv_size(preset)
        out.append({"model": label, "kind": kind, "layers": s.num_layers,
                    "per_layer": f"2 x {s.num_kv_heads} K/V heads x {s.head_dim}",
                    "bytes_per_token": s.bytes_per_token})
    s = kv_size("llama-3-8b")
    out.append({"model": "Llama-3-8B with 1 K/V head", "kind": "MQA", "layers": s.num_layers,
                "per_layer": f"2 x 1 K/V head x {s.head_dim}",
                "bytes_per_token": 2 * s.num_layers * 1 * s.head_dim * BYTES})
    out.append({"model": "DeepSeek-V2", "kind": "MLA", "layers": DSV2_LAYERS,
                "per_layer": f"latent {DSV2_KV_LORA_RANK} + rotary key {DSV2_ROPE_DIM}",
                "bytes_per_token": DSV2_LAYERS * (DSV2_KV_LORA_RANK + DSV2_ROPE_DIM) * BYTES})
    full = DSV2_HEADS * ((DSV2_NOPE_DIM + DSV2_ROPE_DIM) + DSV2_V_DIM)
    out.append({"model": "DeepSeek-V2 without the latent", "kind": "MHA", "layers": DSV2_LAYERS,
                "per_layer": f"{DSV2_HEADS} heads x (K {DSV2_NOPE_DIM + DSV2_ROPE_DIM} "
                             f"+ V {DSV2_V_DIM})",
                "bytes_per_token": DSV2_LAYERS * full * BYTES})
    for r in out:
        r["kib_per_token"] = r["bytes_per_token"] / 1024
        r["tokens_per_gib"] = GIB // r["bytes_per_token"]
    return out


COLORS = {"MHA": "#c53030", "GQA": "#2b6cb0", "MQA": "#2f855a", "MLA": "#6b46c1"}


def draw(table: list[dict], path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    labels = [f"{r['model']} ({r['kind']})" for r in table]
    values = [r["kib_per_token"] for r in table]
    y = list(range(len(table)))[::-1]
    ax.barh(y, values, color=[COLORS[r["kind"]] for r in table])
    for yi, r in zip(y, table, strict=True):
        ax.text(r["kib_per_token"] * 1.08, yi,
                T(f"{r['kib_per_token']:,.1f} KiB   ({r['tokens_per_gib']:,} tokens per GiB)",
                  f"{r['kib_per_token']:,.1f} KiB   (GiB당 토큰 {r['tokens_per_gib']:,}개)"),
                va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xscale("log")
    ax.set_xlim(8, 400_000)
    ax.set_xlabel(T("KV cache per token, all layers (KiB, log scale), fp16/bf16",
                    "토큰당 KV 캐시, 모든 레이어 (KiB, 로그 눈금), fp16/bf16"))
    ax.set_title(T("What one token costs in the KV cache", "토큰 하나가 KV 캐시에서 차지하는 크기"),
                 fontsize=11)
    ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    table = rows()
    (HERE / "kv_bytes_per_token.json").write_text(json.dumps(table, indent=1) + "\n")
    figlang.draw_both(draw, HERE / "kv_bytes_per_token.png", table)
    for r in table:
        print(f"  {r['model']:32} {r['kind']}  {r['bytes_per_token']:>10,} B  "
              f"{r['kib_per_token']:8.1f} KiB  {r['tokens_per_gib']:>6,} tokens/GiB")


if __name__ == "__main__":
    main()

"""Memory traffic of naive versus tiled attention, from the formulas (lesson 11's figure).

One attention layer of Llama-3-8B (32 query heads, 8 K/V heads, head_dim 128, bf16: 2 bytes per
element), for contexts of 512 to 8192 tokens. Bytes between HBM and the chip, counted from what
each method must load and store:

**Prefill** of N tokens (a whole prompt, causal):

- naive: read Q, K and V once, write the N x N scores S, read them back for the softmax, write
  the probabilities P, read them back for P·V, write O. Per layer:
  ``b (2 H N d + 2 Hkv N d + 4 H N^2)``. S and P are counted at 2 bytes, the kindest case
  (eager implementations often keep them in float32).
- tiled, as the kernel of ``kernels/paged_attention.py`` runs a prefill: programs of BLOCK_M =
  128 rows (32 queries x a group of 4 heads) per K/V head; each reads its queries once, writes
  its output once, and reads the K/V tiles (TILE_N = 64 keys) up to its last query's position.
  Two bounds: every tile read from HBM (no cache helps), and each head's K/V read from HBM once
  (the re-reads of later programs hit the L2 cache, the usual case: one head's K/V at 8192
  tokens is 4 MiB).

**Decode**, one query at context N: naive writes and reads scores and probabilities of N keys
per head; tiled reads K/V once and keeps the rest on chip. Both read the same K/V.

    .venv/bin/python lessons/figures/attention_traffic.py    # under a second

It writes attention_traffic.json (every number), attention_traffic.png and its Korean edition
attention_traffic.ko.png (figlang.py) next to itself, and
prints the table the lesson quotes. Times are bytes / 3.35 TB/s (H100 SXM) and FLOPs /
990 TFLOP/s: floors, not measurements.
"""

import json
from pathlib import Path

import figlang

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, HEAD_DIM, BYTES = 32, 8, 128, 2  # Llama-3-8B, bf16
LAYERS = 32
BLOCK_M, TILE_N = 128, 64  # the kernel's prefill tiles (kernels/paged_attention.py, _choose_tiles)
CONTEXTS = [512, 1024, 2048, 4096, 8192]
BANDWIDTH = 3.35e12  # bytes/s, H100 SXM HBM3
FLOPS = 990e12  # dense bf16 FLOP/s, H100 SXM


def naive_prefill(n: int) -> int:
    linear = 2 * HEADS * n * HEAD_DIM + 2 * KV_HEADS * n * HEAD_DIM  # Q in, O out; K, V in
    scores = 4 * HEADS * n * n  # write S, read S, write P, read P
    return BYTES * (linear + scores)


def tiled_keys_read(n: int) -> int:
    """Key positions one K/V head's programs read in total, tile by tile, causal."""
    block_q = BLOCK_M // (HEADS // KV_HEADS)  # queries per program
    total = 0
    for first in range(0, n, block_q):
        last = min(n, first + block_q)  # one past the program's last query
        total += -(-last // TILE_N) * TILE_N  # whole tiles up to the last visible key
    return total


def tiled_prefill(n: int, kv_once: bool) -> int:
    linear = 2 * HEADS * n * HEAD_DIM  # Q in, O out
    keys = n if kv_once else tiled_keys_read(n)
    return BYTES * (linear + 2 * KV_HEADS * keys * HEAD_DIM)


def naive_decode(n: int) -> int:
    return BYTES * (2 * HEADS * HEAD_DIM + 2 * KV_HEADS * n * HEAD_DIM + 4 * HEADS * n)


def tiled_decode(n: int) -> int:
    return BYTES * (2 * HEADS * HEAD_DIM + 2 * KV_HEADS * n * HEAD_DIM)


def prefill_flops(n: int) -> int:
    """QK^T and PV over the causal half: 2 matmuls x 2 FLOPs x H x d x N^2 / 2."""
    return 2 * HEADS * HEAD_DIM * n * n


def compute() -> dict:
    rows = []
    for n in CONTEXTS:
        rows.append({
            "context": n,
            "prefill_naive": naive_prefill(n),
            "prefill_tiled_every_tile": tiled_prefill(n, kv_once=False),
            "prefill_tiled_kv_once": tiled_prefill(n, kv_once=True),
            "prefill_flops": prefill_flops(n),
            "decode_naive": naive_decode(n),
            "decode_tiled": tiled_decode(n),
        })
    return {"config": {"model": "llama-3-8b", "heads": HEADS, "kv_heads": KV_HEADS,
                       "head_dim": HEAD_DIM, "bytes": BYTES, "block_m": BLOCK_M,
                       "tile_n": TILE_N, "bandwidth": BANDWIDTH, "flops": FLOPS,
                       "per": "one layer; decode: one sequence"},
            "rows": rows}


def draw(res: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    T = figlang.chooser(lang)
    rows = res["rows"]
    n = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    mib = 2**20
    left.plot(n, [r["prefill_naive"] / mib for r in rows], "o-", color="#c53030",
              label=T("naive: S and P through HBM", "단순: S와 P가 HBM을 거침"))
    left.plot(n, [r["prefill_tiled_every_tile"] / mib for r in rows], "s-", color="#2b6cb0",
              label=T("tiled: every K/V tile from HBM", "타일링: K/V 타일마다 HBM에서"))
    left.plot(n, [r["prefill_tiled_kv_once"] / mib for r in rows], "^-", color="#2f855a",
              label=T("tiled: K/V from HBM once", "타일링: K/V를 HBM에서 한 번"))
    left.set_title(T("prefill of N tokens, one layer", "토큰 N개의 프리필, 레이어 하나"),
                   fontsize=11)
    right.plot(n, [r["decode_naive"] / mib for r in rows], "o-", color="#c53030",
               label=T("naive", "단순"))
    right.plot(n, [r["decode_tiled"] / mib for r in rows], "^--", color="#2f855a",
               label=T("tiled", "타일링"))
    right.set_title(T("decode: one query at context N, one layer",
                      "디코드: 컨텍스트 N에서 쿼리 하나, 레이어 하나"), fontsize=11)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel(T("context N (tokens)", "컨텍스트 N (토큰)"))
        ax.set_ylabel(T("bytes moved (MiB)", "옮긴 바이트 (MiB)"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_yticks([2, 4, 8, 16, 32])
    fig.suptitle(T("Llama-3-8B attention (32 query heads, 8 K/V heads, head_dim 128, bf16)",
                   "Llama-3-8B 어텐션 (쿼리 헤드 32개, K/V 헤드 8개, head_dim 128, bf16)"),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    res = compute()
    (HERE / "attention_traffic.json").write_text(json.dumps(res, indent=1) + "\n")
    figlang.draw_both(draw, HERE / "attention_traffic.png", res)
    mib = 2**20
    print("per layer, MiB   prefill: naive / every tile / K/V once   decode: naive / tiled")
    for r in res["rows"]:
        print(f"  N = {r['context']:5}   {r['prefill_naive'] / mib:9.1f} "
              f"{r['prefill_tiled_every_tile'] / mib:8.1f} {r['prefill_tiled_kv_once'] / mib:6.1f}"
              f"      {r['decode_naive'] / mib:6.2f} {r['decode_tiled'] / mib:6.2f}")
    last = res["rows"][-1]
    print(f"N = {last['context']}, one layer, H100 floors: "
          f"naive {last['prefill_naive'] / BANDWIDTH * 1e3:.2f} ms,"
          f" every tile {last['prefill_tiled_every_tile'] / BANDWIDTH * 1e3:.2f} ms,"
          f" K/V once {last['prefill_tiled_kv_once'] / BANDWIDTH * 1e3:.3f} ms;"
          f" compute {last['prefill_flops'] / FLOPS * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

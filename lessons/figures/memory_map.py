"""A snapshot of the KV memory under each allocator, at one simulated moment (lesson 2's figure).

The script replays the same synthetic ShareGPT-like trace (reference/sim/traces.py: log-normal
lengths fitted to the paper's means; the real dataset is not shipped) through the simulator
(reference/sim/simulator.py) with each allocator, in OPT-13B's KV budget on an A100-40GB (12 GiB,
15,728 token slots), stops every run at the same step, and draws the whole KV space as one strip
per allocator, lowest slot on the left:

- contiguous (Orca Max, Pow2, Oracle): every slab split into its token states, its reserved
  slots and its internal fragmentation; free gaps grey when too small for the waiting request
  (external fragmentation), white when usable;
- paged (block size 16): every physical block, full or partly filled; no reservation, and a
  free block serves anyone.

    .venv/bin/python lessons/figures/memory_map.py      # a few seconds

It writes memory_map.png and its Korean edition memory_map.ko.png (figlang.py).
"""

import argparse
from pathlib import Path

import figlang

from pagedllm.reference.kv_size import GIB, kv_size
from pagedllm.reference.sim.simulator import Simulator, make_kv
from pagedllm.reference.sim.traces import synthetic_trace

HERE = Path(__file__).resolve().parent
ALLOCATORS = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)",
              "paged": "vLLM (paged, blocks of 16)"}
COLORS = {"token_states": "#2b6cb0", "reserved": "#9dc3e6", "internal": "#d9534f",
          "external": "#8c8c8c", "free": "#ffffff"}
NAMES = {"token_states": "token states", "reserved": "reserved", "internal": "internal frag.",
         "external": "external frag.", "free": "free"}
NAMES_KO = {"token_states": "토큰 상태", "reserved": "예약", "internal": "내부 단편화",
            "external": "외부 단편화", "free": "빈 공간"}


def snapshot(allocator: str, step: int, total_slots: int, seed: int) -> tuple[list, dict, list]:
    """Run to `step`; return [(start, length, part)] segments, the parts' shares, slab outlines."""
    trace = synthetic_trace("sharegpt", 400, rate=1.0, seed=seed)  # more load than anyone serves
    sim = Simulator(trace, make_kv(allocator, total_slots))
    for _ in range(step):
        sim.step()
    head = sim.waiting[0] if sim.waiting else None
    parts = sim.kv.accounting(head)
    shares = {name: getattr(parts, name) / total_slots for name in COLORS}
    segments = []
    if allocator == "paged":
        manager, bs = sim.kv.manager, sim.kv.block_size
        for table in manager.tables.values():
            for i, block in enumerate(table.blocks):
                filled = min(bs, table.num_tokens - i * bs)  # only the last block is partial
                segments.append((block * bs, filled, "token_states"))
                if filled < bs:
                    segments.append((block * bs + filled, bs - filled, "internal"))
        for block in manager.gpu.free_list:
            segments.append((block * bs, bs, "free"))
        return segments, shares, []
    alloc = sim.kv.allocator
    need = None if head is None else alloc.reservation(head.request.prompt_len,
                                                        head.request.output_len)
    for slab in alloc.slabs:
        segments.append((slab.start, slab.num_tokens, "token_states"))
        segments.append((slab.start + slab.num_tokens, slab.will_use - slab.num_tokens,
                         "reserved"))
        segments.append((slab.start + slab.will_use, slab.length - slab.will_use, "internal"))
    for start, size in alloc.gaps():
        segments.append((start, size, "external" if need and size < need else "free"))
    return segments, shares, [(slab.start, slab.length) for slab in alloc.slabs]


def draw(step: int, seed: int, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    T = figlang.chooser(lang)
    names = {p: T(NAMES[p], NAMES_KO[p]) for p in NAMES}
    total_slots = int(12 * GIB) // kv_size("opt-13b").bytes_per_token
    fig, axes = plt.subplots(len(ALLOCATORS), 1, figsize=(11, 5.6), sharex=True)
    for ax, (allocator, label) in zip(axes, ALLOCATORS.items(), strict=True):
        segments, shares, slabs = snapshot(allocator, step, total_slots, seed)
        for part in COLORS:
            bars = [(start, length) for start, length, p in segments if p == part and length]
            ax.broken_barh(bars, (0, 1), facecolors=COLORS[part], edgecolor="none")
        for start, length in slabs:
            ax.add_patch(plt.Rectangle((start, 0), length, 1, fill=False, lw=0.9,
                                       edgecolor="black"))
        ax.add_patch(plt.Rectangle((0, 0), total_slots, 1, fill=False, lw=0.6, edgecolor="#444"))
        ax.set_ylim(-0.05, 1.05)
        ax.set_yticks([])
        summary = "   ".join(f"{names[p]} {100 * shares[p]:.0f}%" for p in COLORS if shares[p])
        label = T(label, label.replace("paged, blocks of 16", "페이징, 블록 크기 16"))
        ax.set_title(f"{label}:   {summary}", loc="left", fontsize=9.5)
        for spine in ax.spines.values():
            spine.set_visible(False)
    axes[-1].set_xlim(0, total_slots)
    axes[-1].set_xlabel(T(f"KV slot (OPT-13B, 12 GiB = {total_slots:,} token slots)",
                          f"KV 슬롯 (OPT-13B, 12 GiB = 토큰 슬롯 {total_slots:,}개)"))
    handles = [Patch(facecolor=COLORS[p], edgecolor="#444", label=names[p]) for p in COLORS]
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False, fontsize=9)
    fig.suptitle(T(f"One moment (step {step}) of the same ShareGPT-like trace under four "
                   "allocators; black outlines are slabs",
                   f"같은 ShareGPT 유사 트레이스의 한 순간(스텝 {step})을 네 할당자로; 검은 "
                   "테두리가 슬랩"), fontsize=10.5)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=int, default=400, help="the simulated moment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "memory_map.png")
    args = parser.parse_args(argv)
    for path in figlang.draw_both(draw, args.out, args.step, args.seed):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

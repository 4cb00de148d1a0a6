"""Block tables of three sequences sharing one pool of physical blocks (lesson 3's figure).

The script runs the real BlockSpaceManager (reference/kv/block_manager.py): a pool of 16 blocks of
4 token slots, three sequences with prompts of 5, 2 and 9 tokens, allocated in that order, then
grown by one token each, round-robin, for 10 decode steps, as a serving engine's batch grows.
It prints every block table and draws:

- top: the physical pool, one box per block, each slot coloured by the sequence that owns it
  and labelled with the token position it holds (empty slots of an owned block hatched, free
  blocks white);
- bottom: each sequence's logical view (its tokens in order, block_size to a logical block),
  with an arrow from every logical block to the physical block its block table names.

    .venv/bin/python lessons/figures/block_tables.py    # about a second

It writes block_tables.png and its Korean edition block_tables.ko.png (figlang.py).
"""

import argparse
from pathlib import Path

import figlang

from pagedllm.reference.kv.block_manager import BlockSpaceManager

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPTS = {"A": 5, "B": 2, "C": 9}  # sequence name -> prompt length (tokens)
DECODE_STEPS = 10
COLORS = {"A": "#2b6cb0", "B": "#d97706", "C": "#2f855a"}
EXAMPLE = ("A", 9)  # the slot-mapping example worked out in the figure and in lesson 3


def run() -> BlockSpaceManager:
    """Allocate the prompts, then grow every sequence one token per step, round-robin."""
    manager = BlockSpaceManager(BLOCK_SIZE, NUM_BLOCKS)
    ids = {name: i for i, name in enumerate(PROMPTS)}
    for name, prompt_len in PROMPTS.items():
        manager.allocate(ids[name], prompt_len)  # the prompt's blocks, at admission
    for _ in range(DECODE_STEPS):
        for name in PROMPTS:
            _, copy = manager.append_slot(ids[name])  # a new block only when the last is full
            assert copy is None  # nothing is shared here, so nothing is copied on write
    return manager


def describe(manager: BlockSpaceManager) -> str:
    lines = [f"block_size {BLOCK_SIZE}, pool of {NUM_BLOCKS} blocks; prompts "
             + ", ".join(f"{n} {p}" for n, p in PROMPTS.items())
             + f", then {DECODE_STEPS} decode steps round-robin"]
    for seq_id, name in enumerate(PROMPTS):
        n = manager.num_tokens(seq_id)
        table = manager.block_table(seq_id)
        empty = len(table) * BLOCK_SIZE - n
        lines.append(f"  {name}: {n:2} tokens, block table {table}  (empty slots in its last "
                     f"block: {empty})")
    lines.append(f"  free blocks: {sorted(manager.gpu.free_list)}")
    name, pos = EXAMPLE
    seq_id = list(PROMPTS).index(name)
    table = manager.block_table(seq_id)
    lines.append(f"  slot of {name}'s position {pos}: block_table[{pos} // {BLOCK_SIZE}] * "
                 f"{BLOCK_SIZE} + {pos} % {BLOCK_SIZE} = {table[pos // BLOCK_SIZE]} * "
                 f"{BLOCK_SIZE} + {pos % BLOCK_SIZE} = {manager.slot(seq_id, pos)}")
    return "\n".join(lines)


def draw(manager: BlockSpaceManager, path: Path, lang: str = "en") -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    slot_w, block_gap = 1.0, 0.4
    block_w = BLOCK_SIZE * slot_w
    pool_y, logical_y, h = 5.2, 0.0, 0.75
    ex_name, ex_pos = EXAMPLE
    ex_id = list(PROMPTS).index(ex_name)
    ex_slot = manager.slot(ex_id, ex_pos)
    T = figlang.chooser(lang)

    def pool_x(block: int) -> float:
        return block * (block_w + block_gap)

    def slot_box(x, y, name, label, outlined=False):
        """One token slot: coloured and labelled when it holds a token, hatched when empty."""
        if label is None:  # owned by `name` but not written yet: the internal waste
            ax.add_patch(Rectangle((x, y), slot_w, h, facecolor="white", edgecolor=COLORS[name],
                                   hatch="////", lw=0.6))
            return
        ax.add_patch(Rectangle((x, y), slot_w, h, facecolor=COLORS[name],
                               edgecolor="black" if outlined else "white",
                               lw=2.2 if outlined else 0.8, zorder=3 if outlined else 2))
        ax.text(x + slot_w / 2, y + h / 2, label, ha="center", va="center", fontsize=9,
                color="white", fontweight="bold", zorder=4)

    # What every physical slot holds: slot -> (sequence, position); block -> owning sequence.
    holds, owner = {}, {}
    for seq_id, name in enumerate(PROMPTS):
        for pos in range(manager.num_tokens(seq_id)):
            holds[manager.slot(seq_id, pos)] = (name, pos)
        for block in manager.block_table(seq_id):
            owner[block] = name

    pool_width = pool_x(NUM_BLOCKS) - block_gap
    fig, ax = plt.subplots(figsize=(14, 6.2))

    # The physical pool, slot 0 on the left.
    for block in range(NUM_BLOCKS):
        x0 = pool_x(block)
        name = owner.get(block)
        for off in range(BLOCK_SIZE):
            slot = block * BLOCK_SIZE + off
            x = x0 + off * slot_w
            if slot in holds:
                seq, pos = holds[slot]
                slot_box(x, pool_y, seq, str(pos), outlined=slot == ex_slot)
            elif name:
                slot_box(x, pool_y, name, None)
            else:
                ax.add_patch(Rectangle((x, pool_y), slot_w, h, facecolor="white",
                                       edgecolor="#cccccc", lw=0.6))
        ax.add_patch(Rectangle((x0, pool_y), block_w, h, fill=False, lw=1.6,
                               edgecolor=COLORS[name] if name else "#aaaaaa"))
        ax.text(x0 + block_w / 2, pool_y + h + 0.12, T(f"block {block}", f"블록 {block}"),
                ha="center", va="bottom", fontsize=9.5, color=COLORS[name] if name else "#999999",
                fontweight="bold" if name else "normal")
        first, last = block * BLOCK_SIZE, block * BLOCK_SIZE + BLOCK_SIZE - 1
        ax.text(x0 + block_w / 2, pool_y - 0.1, T(f"slots {first}-{last}", f"슬롯 {first}-{last}"),
                ha="center", va="top", fontsize=7.5,
                color="#666666")
    free = manager.num_free_gpu_blocks
    ax.text(0, pool_y + h + 0.75, T(
        f"Physical pool: {NUM_BLOCKS} blocks of {BLOCK_SIZE} token slots ({free} free), "
        "coloured by owner. A number is the token position the slot holds.",
        f"물리 풀: 토큰 슬롯 {BLOCK_SIZE}개짜리 블록 {NUM_BLOCKS}개(빈 블록 {free}개), 색은 "
        "주인 시퀀스. 숫자는 그 슬롯이 담은 토큰의 위치."), fontsize=11, ha="left", va="bottom")

    # Each sequence's logical blocks, side by side, an arrow from each to its physical block.
    x = 0.0
    for seq_id, name in enumerate(PROMPTS):
        n = manager.num_tokens(seq_id)
        table = manager.block_table(seq_id)
        start = x
        for logical, block in enumerate(table):
            x0 = x + logical * (block_w + block_gap)
            for off in range(BLOCK_SIZE):
                pos = logical * BLOCK_SIZE + off
                slot_box(x0 + off * slot_w, logical_y, name, str(pos) if pos < n else None,
                         outlined=(name, pos) == EXAMPLE)
            ax.add_patch(Rectangle((x0, logical_y), block_w, h, fill=False, lw=1.6,
                                   edgecolor=COLORS[name]))
            ax.text(x0 + block_w / 2, logical_y - 0.1, T(f"logical {logical}", f"논리 {logical}"),
                    ha="center", va="top", fontsize=8.5)
            ax.add_patch(FancyArrowPatch((x0 + block_w / 2, logical_y + h + 0.05),
                                         (pool_x(block) + block_w / 2, pool_y - 0.5),
                                         arrowstyle="-|>", mutation_scale=14, lw=1.5,
                                         color=COLORS[name], alpha=0.9))
        end = x + len(table) * (block_w + block_gap) - block_gap
        ax.text((start + end) / 2, logical_y - 0.65,
                T(f"sequence {name}: {n} tokens\nblock table {table}",
                  f"시퀀스 {name}: 토큰 {n}개\n블록 테이블 {table}"), ha="center", va="top",
                fontsize=10.5, color=COLORS[name], fontweight="bold")
        x = end + 2.5

    ex_table = manager.block_table(ex_id)
    formula = (f"block_table[{ex_pos} // {BLOCK_SIZE}] × {BLOCK_SIZE} + {ex_pos} % "
               f"{BLOCK_SIZE} = {ex_table[ex_pos // BLOCK_SIZE]} × {BLOCK_SIZE} + "
               f"{ex_pos % BLOCK_SIZE} = {ex_slot}")
    ax.text(0, -2.35, T(
        f"Outlined: {ex_name}'s position {ex_pos} lives in slot {formula}.   "
        "Hatched: allocated, still empty.",
        f"굵은 테두리: {ex_name}의 위치 {ex_pos}가 있는 슬롯 {formula}.   "
        "빗금: 할당되었지만 아직 빈 슬롯."), ha="left", va="top", fontsize=10.5)
    ax.text(pool_width, logical_y + h + 0.9, T(
        "Below: each sequence's logical view,\nits tokens in order, "
        f"{BLOCK_SIZE} to a logical block;\nan arrow is one block-table entry",
        "아래: 시퀀스마다의 논리적 보기,\n토큰을 순서대로, 논리 블록 하나에 "
        f"{BLOCK_SIZE}개씩;\n화살표 하나가 블록 테이블 항목 하나"),
        fontsize=10.5, ha="right", va="bottom")
    handles = [Patch(facecolor=COLORS[n], label=T(f"sequence {n} (prompt {p})",
                                                  f"시퀀스 {n} (프롬프트 {p})"))
               for n, p in PROMPTS.items()]
    handles.append(Patch(facecolor="white", edgecolor="#aaaaaa",
                         label=T("free block", "빈 블록")))
    ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, 0.36), fontsize=9.5,
              frameon=False)

    ax.set_xlim(-0.3, pool_width + 0.3)
    ax.set_ylim(-2.9, pool_y + h + 1.35)
    ax.axis("off")
    fig.suptitle(T(f"Three sequences grown round-robin in one pool (block_size {BLOCK_SIZE}): "
                   "their blocks interleave; each block table finds its own",
                   f"한 풀에서 번갈아 자라는 세 시퀀스(block_size {BLOCK_SIZE}): 블록은 서로 "
                   "섞이고, 블록 테이블이 저마다 제 블록을 찾는다"), fontsize=12.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "block_tables.png")
    args = parser.parse_args(argv)
    manager = run()
    print(describe(manager))
    for path in figlang.draw_both(draw, args.out, manager):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

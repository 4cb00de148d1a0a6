"""Solution to lesson 13's exercise: bytes moved by a chain of ops, one kernel each or fused."""


def unfused_bytes(ops, sizes):
    return sum(sizes[t] for _, reads, writes in ops for t in (*reads, *writes))


def fused_bytes(ops, sizes, outputs):
    produced = {t for _, _, writes in ops for t in writes}
    inputs = {t for _, reads, _ in ops for t in reads} - produced  # loaded once each
    stored = produced & set(outputs)  # everything else stays in registers
    return sum(sizes[t] for t in inputs | stored)

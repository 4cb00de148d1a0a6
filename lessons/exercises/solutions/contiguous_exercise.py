"""A solution to lesson 2's exercise: first-fit slabs and the five-way split of the KV space.

The free gaps are the spaces between the live slabs sorted by start, plus the tail after the
last one. First fit takes the lowest gap at least as long as the slab. In the accounting, a slab
splits into the tokens it holds now, the slots its future tokens will fill, and the slots never
to be filled; a free gap is external fragmentation when the next request's slab does not fit in
it, and free otherwise (all free when nobody waits).
"""


def gaps(total_slots: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Free runs (start, length), lowest address first, between spans (start, length)."""
    result, cursor = [], 0
    for start, length in sorted(spans):
        if start > cursor:
            result.append((cursor, start - cursor))
        cursor = start + length
    if cursor < total_slots:
        result.append((cursor, total_slots - cursor))
    return result


def place(total_slots: int, events: list[tuple]) -> list[int | None]:
    """First-fit placement of slabs; one result per "alloc" event."""
    live: dict = {}  # request_id -> (start, length)
    starts: list[int | None] = []
    for event in events:
        if event[0] == "free":
            del live[event[1]]
            continue
        _, request_id, length = event
        start = next((s for s, size in gaps(total_slots, list(live.values())) if size >= length),
                     None)
        if start is not None:
            live[request_id] = (start, length)
        starts.append(start)
    return starts


def accounting(total_slots: int, slabs: list[tuple[int, int, int, int]],
               next_need: int | None) -> tuple[int, int, int, int, int]:
    """(token_states, reserved, internal, external, free): where every slot is, now."""
    token_states = sum(tokens for _, _, tokens, _ in slabs)
    reserved = sum(will_use - tokens for _, _, tokens, will_use in slabs)
    internal = sum(length - will_use for _, length, _, will_use in slabs)
    sizes = [size for _, size in gaps(total_slots, [(s, n) for s, n, _, _ in slabs])]
    external = 0 if next_need is None else sum(size for size in sizes if size < next_need)
    return token_states, reserved, internal, external, sum(sizes) - external

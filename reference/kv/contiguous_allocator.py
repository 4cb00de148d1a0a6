"""Contiguous KV memory: one slab per request, reserved at admission (the paper's Orca baselines).

Before paging, a serving engine kept each request's keys and values in one contiguous run of
token slots: attention kernels then read a request's K/V as one dense array. The catch is that
the slab must be reserved when the request is admitted, before anyone knows how many tokens it
will generate, and it cannot grow later (its neighbours are in the way). The PagedAttention paper
(Kwon et al., SOSP 2023, Figure 2) measures three ways such slabs waste memory, with three
reservation policies of Orca:

- ``max``:    reserve the model's maximum length (2048 slots for OPT-13B), whatever the request;
- ``pow2``:   reserve prompt + the output length rounded up to a power of two (at most 2x over);
- ``oracle``: reserve prompt + the true output length (an upper bound no real system has).

At any moment every slot of the KV space is exactly one of five things (all counted in slots):

- token states:     holds the K/V of a token of a running request, now;
- reserved:         inside a slab, empty now, but this request's future tokens will fill it;
- internal frag.:   inside a slab, and will never be filled (the request ends first);
- external frag.:   free, but in a gap too small for the slab the next waiting request needs;
- free:             free and usable (in a gap big enough for the next request, or nobody waits).

The five always sum to ``total_slots``. External fragmentation is defined against the request
at the head of the waiting queue, because under first-come-first-served admission that is the
only request allowed in next: a free gap it cannot use is wasted, however big the gap. That
includes the case where even all free slots together would be too small (compaction would not
help); the paper's Orca (Max) bar counts those slots the same way: 15,728 slots hold seven
2048-slot slabs and leave 1,392 slots (8.9 %) that no request can ever use. When nothing waits,
no free slot is wasted yet and all of them count as free. The paper's bar has no "free" part; its
"external fragmentation & others" column is our external + free.

The split between reserved and internal needs the request's true output length, which a real
engine learns only when the request finishes; the simulator knows it and passes it in. The
``max`` policy does not use it to choose the slab size, ``oracle`` and ``pow2`` do.

Placement is first-fit: the lowest-addressed free gap that is large enough. The slot of the
token at position p of request r is ``slab(r)[0] + p``: a model cache can lay its K/V rows over
the slabs exactly like that.
"""

import bisect
from dataclasses import dataclass

POLICIES = ("max", "pow2", "oracle")


@dataclass
class Slab:
    """One request's reservation: slots [start, start + length) of the linear KV space."""

    request_id: int
    start: int
    length: int  # slots reserved
    prompt_len: int
    output_len: int  # the request's true output length (tokens it will generate)
    num_tokens: int  # slots holding K/V now: the prompt, then one more per generated token

    @property
    def will_use(self) -> int:
        """Slots this request fills by the time it finishes; never more than length."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class KVAccounting:
    """Where every slot of the KV space is, at one moment (units: token slots)."""

    token_states: int
    reserved: int
    internal: int
    external: int
    free: int

    @property
    def total(self) -> int:
        return self.token_states + self.reserved + self.internal + self.external + self.free


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1): 25 -> 32, 32 -> 32."""
    return 1 << (n - 1).bit_length()


class ContiguousAllocator:
    """A linear KV space of total_slots token slots, carved into one slab per request."""

    def __init__(self, total_slots: int, policy: str = "max", max_len: int = 2048):
        if policy not in POLICIES:
            raise ValueError(f"unknown reservation policy {policy!r}; choose one of "
                             f"{', '.join(POLICIES)}")
        if total_slots < 1:
            raise ValueError(f"total_slots must be >= 1, got {total_slots}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.total_slots = total_slots
        self.policy = policy
        self.max_len = max_len  # the model's maximum sequence length (prompt + output)
        self.slabs: list[Slab] = []  # sorted by start address
        self._by_id: dict[int, Slab] = {}

    # --8<-- [start:reservation]
    def reservation(self, prompt_len: int, output_len: int) -> int:
        """Slots a request reserves at admission under this allocator's policy."""
        self._check_lengths(prompt_len, output_len)
        if self.policy == "max":
            return self.max_len  # room for the longest sequence the model allows
        # pow2: the output rounded up, at most 2x over, never past max_len
        if self.policy == "pow2":
            return min(prompt_len + next_power_of_two(output_len), self.max_len)
        return prompt_len + output_len  # oracle: exactly what the request will use
    # --8<-- [end:reservation]

    def _check_lengths(self, prompt_len: int, output_len: int) -> None:
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len} and "
                             f"{output_len}")
        if prompt_len + output_len > self.max_len:
            raise ValueError(f"prompt_len + output_len = {prompt_len + output_len} exceeds the "
                             f"model's max_len of {self.max_len}")

    # --8<-- [start:first_fit]
    def gaps(self) -> list[tuple[int, int]]:
        """Free runs of slots as (start, length), lowest address first."""
        gaps, cursor = [], 0
        for slab in self.slabs:  # slabs are sorted by start: the gaps lie between them
            if slab.start > cursor:
                gaps.append((cursor, slab.start - cursor))
            cursor = slab.start + slab.length
        if cursor < self.total_slots:
            gaps.append((cursor, self.total_slots - cursor))
        return gaps

    def find_gap(self, length: int) -> int | None:
        """First fit: the start of the lowest free gap of at least length slots, or None."""
        for start, size in self.gaps():
            if size >= length:
                return start
        return None
    # --8<-- [end:first_fit]

    def can_allocate(self, prompt_len: int, output_len: int) -> bool:
        return self.find_gap(self.reservation(prompt_len, output_len)) is not None

    # --8<-- [start:allocate]
    def allocate(self, request_id: int, prompt_len: int, output_len: int) -> int:
        """Reserve a slab for a new request and fill its prompt's slots; returns the slab
        start.

        ValueError when the request could never fit (bigger than the whole space, or than
        max_len) or already holds a slab; RuntimeError when it only has to wait (no gap fits
        now). Either way nothing changes.
        """
        if request_id in self._by_id:
            raise ValueError(f"request {request_id} already holds a slab; free it first")
        length = self.reservation(prompt_len, output_len)
        if length > self.total_slots:
            raise ValueError(f"request {request_id} reserves {length} slots under policy "
                             f"{self.policy!r}, more than the whole KV space of "
                             f"{self.total_slots} slots: it can never be admitted")
        start = self.find_gap(length)
        if start is None:
            largest = max((size for _, size in self.gaps()), default=0)
            raise RuntimeError(f"no free gap of {length} slots (the largest is {largest}): "
                               "check can_allocate first")
        slab = Slab(request_id, start, length, prompt_len, output_len,
                    num_tokens=prompt_len)
        bisect.insort(self.slabs, slab, key=lambda s: s.start)
        self._by_id[request_id] = slab
        return start
    # --8<-- [end:allocate]

    def append_slot(self, request_id: int) -> int:
        """Take the slot of the request's next token (decode); returns its address."""
        slab = self._slab(request_id)
        if slab.num_tokens >= slab.will_use:
            raise ValueError(f"request {request_id} already holds all its prompt_len + "
                             f"output_len = {slab.will_use} tokens; it declared no more")
        slot = slab.start + slab.num_tokens  # position p lives at start + p
        slab.num_tokens += 1
        return slot

    def truncate(self, request_id: int, num_tokens: int) -> None:
        """Keep the slots of the first num_tokens tokens (the slab stays reserved)."""
        slab = self._slab(request_id)
        if not 0 <= num_tokens <= slab.num_tokens:
            raise ValueError(f"request {request_id} holds {slab.num_tokens} tokens; it cannot "
                             f"keep {num_tokens}")
        slab.num_tokens = num_tokens

    def free(self, request_id: int) -> None:
        """Release the whole slab: its slots become a free gap (merged with free neighbours)."""
        slab = self._slab(request_id)
        del self._by_id[request_id]
        self.slabs.remove(slab)

    def slab(self, request_id: int) -> tuple[int, int]:
        """(start, length) of the request's slab: token position p has slot start + p."""
        slab = self._slab(request_id)
        return slab.start, slab.length

    def holds(self, request_id: int) -> bool:
        return request_id in self._by_id

    def num_tokens(self, request_id: int) -> int:
        return self._slab(request_id).num_tokens

    def _slab(self, request_id: int) -> Slab:
        slab = self._by_id.get(request_id)
        if slab is None:
            raise ValueError(f"request {request_id} holds no slab (never allocated, or freed "
                             "already)")
        return slab

    # --8<-- [start:accounting]
    def accounting(self, next_request: tuple[int, int] | None = None) -> KVAccounting:
        """Split all total_slots into the five parts, now.

        next_request is (prompt_len, output_len) of the request at the head of the waiting
        queue, or None when nothing waits: free gaps smaller than its slab are external
        fragmentation, the rest of the free slots are free.
        """
        token_states = sum(s.num_tokens for s in self.slabs)
        # slots held for the future tokens
        reserved = sum(s.will_use - s.num_tokens for s in self.slabs)
        internal = sum(s.length - s.will_use for s in self.slabs)  # never to be used
        need = None if next_request is None else self.reservation(*next_request)
        gap_sizes = [size for _, size in self.gaps()]
        external = 0 if need is None else sum(size for size in gap_sizes if size < need)
        free = sum(gap_sizes) - external
        return KVAccounting(token_states, reserved, internal, external, free)
    # --8<-- [end:accounting]

"""From a batch of next-token logits to one token per row: the sampler.

Order, per row: the reported logprobs are the log_softmax of the raw logits (the model's own
distribution, as vLLM reports it by default). Then blocked tokens (EOS and stop tokens while
min_tokens is not reached) get -inf. A greedy row (temperature below 1e-5) takes the argmax.
Any other row divides its logits by the temperature, keeps its top_k largest, takes the softmax,
keeps the top_p head of that distribution, renormalises and draws.

**The exponential race.** To draw token i with probability p_i, give every token an independent
E_i ~ Exp(1) and take argmax_i p_i / E_i. Each token "arrives" after a time E_i / p_i, an
exponential variable of rate p_i; the first of several independent exponential clocks to ring is
clock i with probability p_i / sum(p) — so the winner is distributed exactly as p. The race
needs one uniform number U_i per token (E_i = -log U_i), no cumulative sum and no search, and
it vectorizes over a whole batch of rows at once.

**Counter-based random numbers.** U is not drawn from a stateful generator. It is a fixed hash
of (stream, position, token id), where the stream is the request's seed plus the sample index
and the position is the index of the token being drawn among the sequence's outputs. A seeded
request's tokens then depend only on its logits: the same alone or batched with others, in any
order, preempted and recomputed or not, on CPU or CUDA, and in the Triton tier, which computes
the same hash bit for bit with uint64 operations. Sample i of a request with seed s uses stream
s + i, so it is the same as a request of its own with seed s + i.
"""

from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # a temperature below this means greedy, as in vLLM
TINIEST_TOP_P = 1.1754943508222875e-38  # float32's smallest normal number


def _int64(x: int) -> int:
    """A Python int reduced to int64 by wrap-around (two's complement, modulo 2**64)."""
    return (x + 2**63) % 2**64 - 2**63


# SplitMix64's constants, written unsigned; torch holds them as their int64 wrap-arounds.
GOLDEN_GAMMA = _int64(0x9E3779B97F4A7C15)
MIX_MULTIPLIER_1 = _int64(0xBF58476D1CE4E5B9)
MIX_MULTIPLIER_2 = _int64(0x94D049BB133111EB)


# --8<-- [start:random]
def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> copies the sign bit in; mask it
    out)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bits; every * and + wraps modulo 2**64."""
    z = (z ^ _shift_right(z, 30)) * MIX_MULTIPLIER_1
    z = (z ^ _shift_right(z, 27)) * MIX_MULTIPLIER_2
    return z ^ _shift_right(z, 31)


def random_uniform(streams: torch.Tensor, positions: torch.Tensor,
                   vocab_size: int) -> torch.Tensor:
    """streams [S] int64, positions [S] int64 -> U [S, vocab_size] float64, strictly in
    (0, 1).

    All arithmetic is on 64-bit words modulo 2**64 (uint64 in Triton; int64 with
    wrap-around here), >>> is a logical right shift, ^ is xor:

        mix64(z):  z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9
                   z = (z ^ (z >>> 27)) * 0x94D049BB133111EB
                   return z ^ (z >>> 31)
        G = 0x9E3779B97F4A7C15
        a = mix64(stream + G)                # one per row
        b = mix64(a + (position + 1) * G)    # one per row
        x = mix64(b + (token + 1) * G)       # one per (row, token), token in [0, vocab)
        U = ((x >>> 12) + 0.5) * 2**-52      # exact in float64

    a is the first output of SplitMix64 seeded with the stream, b the (position+1)-th
    output of SplitMix64 seeded with a, x the (token+1)-th output of SplitMix64 seeded
    with b. U keeps 52 bits so that k + 0.5 is exact in float64: its smallest value is
    2**-53 and its largest 1 - 2**-53 (with 53 bits the largest would round up to 1.0).
    """
    # [vocab]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=streams.device)
    a = _mix64(streams.long() + GOLDEN_GAMMA)  # [S]
    b = _mix64(a + (positions.long() + 1) * GOLDEN_GAMMA)  # [S]
    x = _mix64(b[:, None] + (tokens[None, :] + 1) * GOLDEN_GAMMA)  # [S, vocab]
    return (_shift_right(x, 12).double() + 0.5) * 2.0**-52  # [S, vocab]
# --8<-- [end:random]


@dataclass
class SamplingRow:
    """One row to sample this step, as the engine knows it (plain Python values)."""

    temperature: float = 1.0
    top_k: int = -1  # -1 (or 0, or >= vocab) keeps every token
    top_p: float = 1.0
    stream: int = 0  # request seed + sample index; any int, wrapped to int64
    position: int = 0  # index among the sequence's outputs of the token being drawn
    blocked_token_ids: list[int] = field(default_factory=list)  # forbidden this step
    num_logprobs: int = 0  # top logprobs this row asks for


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the S rows that sample this step, on the logits' device."""

    temperature: torch.Tensor  # [S] float32; below GREEDY_BELOW the row is greedy
    top_k: torch.Tensor  # [S] int64; -1 (or 0, or >= vocab) keeps all
    top_p: torch.Tensor  # [S] float32
    streams: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64
    blocked_token_ids: torch.Tensor  # [S, M] int64, padded with -1
    num_logprobs: int = 0  # the most top logprobs any row asks for; 0 = none

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int,
                  device: torch.device | str = "cpu") -> "SamplingMetadata":
        """Stack the rows' parameters into tensors; streams wrap to int64."""
        for row in rows:
            if any(not 0 <= t < vocab_size for t in row.blocked_token_ids):
                raise ValueError(f"blocked token ids {row.blocked_token_ids} outside the "
                                 f"vocabulary of {vocab_size}")
        width = max((len(row.blocked_token_ids) for row in rows), default=0)
        blocked = [row.blocked_token_ids + [-1] * (width - len(row.blocked_token_ids))
                   for row in rows]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        # top_k at or past the vocabulary keeps every token (and a huge one would overflow
        # int64); a top_p too small for float32 keeps the most likely token, not none.
        return cls(
            temperature=tensor([row.temperature for row in rows], torch.float32),
            top_k=tensor([row.top_k if row.top_k < vocab_size else -1 for row in rows],
                         torch.int64),
            top_p=tensor([max(row.top_p, TINIEST_TOP_P) for row in rows], torch.float32),
            streams=tensor([_int64(row.stream) for row in rows], torch.int64),
            positions=tensor([row.position for row in rows], torch.int64),
            blocked_token_ids=tensor(blocked, torch.int64).reshape(len(rows), width),
            num_logprobs=max((row.num_logprobs for row in rows), default=0),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32, logprob of the chosen token
    top_logprobs: torch.Tensor  # [S, K] float32, K = num_logprobs, largest first
    top_token_ids: torch.Tensor  # [S, K] int64


def _blocked_mask(blocked_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, M] ids padded with -1 -> [S, vocab] bool, True where the token is blocked."""
    S = blocked_token_ids.shape[0]
    ids = blocked_token_ids.masked_fill(blocked_token_ids < 0, vocab_size)  # padding -> spare
    mask = torch.zeros(S, vocab_size + 1, dtype=torch.bool, device=blocked_token_ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]  # [S, vocab], spare column dropped


# --8<-- [start:cut]
def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [S, vocab] -> the renormalised distribution [S, vocab]
    float64 over the tokens that survive top_k, then top_p. Tied tokens survive or fall
    together.

    A row that asks for neither cut (top_k off, top_p = 1) is a plain softmax; only the
    rows that cut are sorted. Which path a row takes depends on its own parameters
    alone.
    """
    S, vocab = scaled.shape
    probs = torch.softmax(scaled, dim=-1).double()  # [S, vocab]
    cuts = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)  # [S]
    if bool(cuts.any()):
        rows = cuts.nonzero()[:, 0]  # [R]
        probs[rows] = _cut(scaled[rows], top_k[rows], top_p[rows])
    return probs / probs.sum(dim=-1, keepdim=True)  # [S, vocab] float64


def _cut(scaled: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor) -> torch.Tensor:
    """The distribution [R, vocab] float64 (not yet renormalised) after the top_k and
    top_p cuts, for rows that ask for at least one of them."""
    R, vocab = scaled.shape
    positions = torch.arange(vocab, device=scaled.device).expand(R, vocab)  # [R, vocab]
    # Softmax does not change the order, so one sort serves both cuts.
    # [R, vocab] each
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)

    # top_k: everything strictly below the k-th largest value is out.
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)  # [R]
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # [R, vocab], descending
    sorted_probs = torch.softmax(sorted_logits, dim=-1).double()

    # top_p: keep a token iff the mass of the tokens strictly more probable than it is
    # below top_p. That mass is the exclusive cumsum at the first position of the
    # token's tie group.
    cumsum = torch.cumsum(sorted_probs, dim=-1)  # [R, vocab]
    mass_before = torch.cat([torch.zeros_like(cumsum[:, :1]), cumsum[:, :-1]], dim=-1)
    starts_group = torch.ones_like(sorted_logits, dtype=torch.bool)  # [R, vocab]
    starts_group[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
    # [R, vocab]
    group_start = torch.where(starts_group, positions, 0).cummax(dim=-1).values
    mass_above = mass_before.gather(1, group_start)  # [R, vocab]
    cut_p = (top_p < 1)[:, None] & (mass_above >= top_p.double()[:, None])  # [R, vocab]
    sorted_probs = sorted_probs.masked_fill(cut_p, 0.0)
    # back in vocab order
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
# --8<-- [end:cut]


# --8<-- [start:sample]
def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """logits [S, vocab] -> one token per row, its logprob and the rows' top
    logprobs."""
    # --8<-- [start:raw_logprobs]
    logits = logits.float()  # [S, vocab]
    S, vocab = logits.shape
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, vocab], reported as is

    if metadata.blocked_token_ids.numel():  # some row has tokens it may not draw yet
        blocked = _blocked_mask(metadata.blocked_token_ids, vocab)  # [S, vocab]
        logits = logits.masked_fill(blocked, float("-inf"))
    # --8<-- [end:raw_logprobs]

    greedy = metadata.temperature < GREEDY_BELOW  # [S]
    greedy_tokens = torch.argmax(logits, dim=-1)  # [S], first index on ties

    token_ids = greedy_tokens.clone()  # [S]
    drawn = (~greedy).nonzero()[:, 0]  # [D] the rows that draw
    if drawn.numel():
        md = metadata
        scaled = logits[drawn] / md.temperature[drawn][:, None]  # [D, vocab]
        probs = _top_k_top_p(scaled, md.top_k[drawn], md.top_p[drawn])  # [D, vocab]
        # The exponential race: token i wins with probability p_i.
        # [D, vocab] float64
        u = random_uniform(md.streams[drawn], md.positions[drawn], vocab)
        race = probs / -torch.log(u)  # [D, vocab], p / E with E ~ Exp(1)
        token_ids[drawn] = torch.argmax(race, dim=-1)  # [D]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]  # [S]
    top = torch.topk(logprobs, min(metadata.num_logprobs, vocab), dim=-1)  # [S, K] each
    return SamplerOutput(token_ids, chosen, top.values, top.indices)
# --8<-- [end:sample]

"""From a batch of next-token logits to one token per row: the sampler.

Order, per row: the reported logprobs are the log_softmax of the raw logits (the model's own
distribution, as vLLM reports it by default). Then blocked tokens (EOS and stop tokens while
min_tokens is not reached) get -inf, and so do the tokens a structured output's grammar forbids
(the row's token bitmask), and the logit transforms run, in vLLM's order: logit_bias
is added, repetition_penalty divides the positive logits and multiplies the negative ones of
every token seen in the prompt or the output, frequency_penalty subtracts once per time a token
was generated and presence_penalty once if it was. A greedy row (temperature below 1e-5) takes
the argmax. Any other row divides its logits by the temperature, drops the tokens less likely
than min_p times the most likely one, keeps its top_k largest, takes the softmax, keeps the
top_p head of that distribution, renormalises and draws. A division or product that would
overflow float32 (a tiny repetition_penalty, then a small temperature) saturates at float32's
largest number instead of becoming inf (``saturate``), so no row's softmax is ever NaN.

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
# The sampler holds temperature and top_p in float32: the limits of the values a request may
# give, defined here once (SamplingParams refuses a temperature past FLOAT32_MAX: the division
# would turn a blocked token's -inf into NaN; a top_p below TINIEST_TOP_P would round to 0 and
# cut every token, so the sampler raises it to that, keeping the most likely token).
FLOAT32_MAX = torch.finfo(torch.float32).max  # 3.4028234663852886e38
TINIEST_TOP_P = torch.finfo(torch.float32).tiny  # float32's smallest normal number, 1.18e-38
# repetition_penalty may be any positive number (vLLM's range), but in float32 one below ~7e-46
# is 0 (a blocked token's -inf times 0 is NaN) and one below 1.18e-38 is subnormal (which a GPU
# may flush to 0): the sampler raises it to float32's smallest normal number. At that size every
# seen token's positive logit lands at FLOAT32_MAX anyway (see saturate).
TINIEST_REPETITION_PENALTY = torch.finfo(torch.float32).tiny


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


def saturate(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = x / a or x * a (a > 0) -> y with an overflow brought back into float32's range:
    where x is finite, y is clamped to [-FLOAT32_MAX, FLOAT32_MAX]; where x is -inf (a
    blocked token) y stays -inf.

    A tiny repetition_penalty divides a positive logit past float32's largest number, and a
    small temperature then divides the penalised logit again: +inf there would make the
    softmax inf - inf = NaN, and the draw's argmax token 0. Saturated, the token is simply as
    likely as float32 can say (tied with any other saturated token); the order of every
    finite value is kept.
    """
    return torch.where(torch.isfinite(x), y.clamp(-FLOAT32_MAX, FLOAT32_MAX), y)


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
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    repetition_penalty: float = 1.0  # 1 is off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    prompt_token_ids: list[int] = field(default_factory=list)  # for repetition_penalty
    output_token_ids: list[int] = field(default_factory=list)  # for all three penalties

    @property
    def transforms_logits(self) -> bool:
        """Whether a penalty or a bias changes this row's logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))


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
    min_p: torch.Tensor | None = None  # [S] float32; 0 keeps all; None: no row asks
    penalties: "Penalties | None" = None  # None: no row transforms its logits
    # [S, ceil(vocab / 32)] int32, bit t of row r: may row r draw token t (structured
    # outputs' grammars; a row without one is all ones); None: no row has a grammar
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int,
                  device: torch.device | str = "cpu",
                  token_bitmask: torch.Tensor | None = None) -> "SamplingMetadata":
        """Stack the rows' parameters into tensors; streams wrap to int64. token_bitmask:
        the rows' grammar bitmask, filled on the CPU (engine/structured_outputs.py)."""
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
            min_p=tensor([row.min_p for row in rows], torch.float32)
            if any(row.min_p for row in rows) else None,
            penalties=Penalties.from_rows(rows, vocab_size, device)
            if any(row.transforms_logits for row in rows) else None,
            token_bitmask=None if token_bitmask is None
            else token_bitmask.to(device, non_blocking=True),
        )


def _padded(lists: list[list], pad, dtype: torch.dtype, device) -> torch.Tensor:
    """Lists of unequal lengths -> one [len(lists), longest] tensor, padded with pad."""
    width = max((len(x) for x in lists), default=0)
    return torch.tensor([list(x) + [pad] * (width - len(x)) for x in lists], dtype=dtype,
                        device=device).reshape(len(lists), width)


@dataclass
class Penalties:
    """The logit transforms' parameters of the S rows (only built when some row has one)."""

    repetition: torch.Tensor  # [S] float32; 1 is off
    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    prompt_token_ids: torch.Tensor  # [S, P] int64, padded with -1
    output_token_ids: torch.Tensor  # [S, O] int64, padded with -1
    bias_token_ids: torch.Tensor  # [S, B] int64, padded with -1 (no id twice in a row)
    bias_values: torch.Tensor  # [S, B] float32, 0 at the padding

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int, device) -> "Penalties":
        for row in rows:
            ids = [*row.logit_bias, *row.prompt_token_ids, *row.output_token_ids]
            if any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"token ids of a row's penalties or logit_bias are outside "
                                 f"the vocabulary of {vocab_size}")

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # A row without a repetition penalty needs no prompt, nor one without any penalty
        # its output: they are left out rather than copied every step.
        return cls(
            repetition=per_row([max(row.repetition_penalty, TINIEST_REPETITION_PENALTY)
                                for row in rows]),
            presence=per_row([row.presence_penalty for row in rows]),
            frequency=per_row([row.frequency_penalty for row in rows]),
            prompt_token_ids=_padded([row.prompt_token_ids
                                      if row.repetition_penalty != 1.0 else []
                                      for row in rows], -1, torch.int64, device),
            output_token_ids=_padded([row.output_token_ids if row.repetition_penalty != 1.0
                                      or row.presence_penalty or row.frequency_penalty
                                      else [] for row in rows], -1, torch.int64, device),
            bias_token_ids=_padded([list(row.logit_bias) for row in rows], -1, torch.int64,
                                   device),
            bias_values=_padded([list(row.logit_bias.values()) for row in rows], 0.0,
                                torch.float32, device),
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


# The int32 with only bit b set, b = 0..31 (bit 31 is the sign bit: -2**31).
ONE_BIT = [1 << b for b in range(31)] + [-(1 << 31)]


# --8<-- [start:token_bitmask]
def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [S, W] bitmask -> bool [S, vocab], True where the token is allowed: token t
    is bit t % 32 of word t // 32 (xgrammar's layout; the low bit first)."""
    bits = torch.tensor(ONE_BIT, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = (bitmask[:, :, None] & bits) != 0  # [S, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size]  # [S, vocab]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, vocab] -> a copy with -inf wherever the grammar forbids the token
    (what xgrammar's apply_token_bitmask_inplace computes, out of place). Only the rows
    that forbid something are unpacked: a row without a grammar is all ones."""
    out = logits.clone()
    rows = (bitmask != -1).any(dim=1).nonzero()[:, 0]  # [R]
    allowed = unpack_bitmask(bitmask[rows], logits.shape[1])  # [R, vocab]
    out[rows] = torch.where(allowed, logits[rows], float("-inf"))
    return out
# --8<-- [end:token_bitmask]


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, M] ids padded with -1 -> [S, vocab] int64: how many times each token occurs."""
    S = token_ids.shape[0]
    ids = token_ids.masked_fill(token_ids < 0, vocab_size)  # padding -> a spare column
    counts = torch.zeros(S, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids))[:, :vocab_size]


def penalty_tensors(penalties: "Penalties", vocab_size: int):
    """The dense per-token inputs of the transforms, each [S, vocab]: the bias (float32),
    whether a token was seen in the prompt or the output (bool), and how many times it
    was generated (int64). Built by scatters, as vLLM builds its bin counts."""
    pen = penalties
    S = pen.bias_token_ids.shape[0]
    ids = pen.bias_token_ids.masked_fill(pen.bias_token_ids < 0, vocab_size)
    bias = torch.zeros(S, vocab_size + 1, dtype=torch.float32, device=ids.device)
    bias = bias.scatter_(1, ids, pen.bias_values)[:, :vocab_size]
    output_counts = _token_counts(pen.output_token_ids, vocab_size)
    seen = (_token_counts(pen.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    return bias, seen, output_counts


# --8<-- [start:penalties]
def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """logits [S, vocab] float32 -> the logits after logit_bias and the three penalties,
    in vLLM's order. Each is a plain elementwise transform of one row's logits:

    - logit_bias adds its value to its tokens' logits (-100 all but bans a token);
    - repetition_penalty r (vLLM's, from the CTRL paper) touches every token seen in
      the prompt or the output: a positive logit is divided by r, a negative one
      multiplied by r, so r > 1 makes a seen token less likely either way; a quotient or
      product past float32's range saturates at its largest number (``saturate``: a
      tiny r must not make +inf, and the softmax NaN);
    - frequency_penalty f and presence_penalty p (OpenAI's) look at the output only:
      logit - f * (times generated) - p * (generated at all).
    """
    vocab = logits.shape[1]
    bias, seen, output_counts = penalty_tensors(penalties, vocab)  # [S, vocab] each
    logits = logits + bias
    r = torch.where(seen, penalties.repetition[:, None], 1.0)  # [S, vocab]
    logits = saturate(torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - penalties.frequency[:, None] * output_counts
    return logits - penalties.presence[:, None] * (output_counts > 0)
# --8<-- [end:penalties]


# --8<-- [start:min_p]
def _min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [R, vocab] -> the same with -inf where a token's
    probability is below min_p times the row's largest (vLLM's min_p, after the
    temperature). min_p = 0 drops nothing; min_p = 1 keeps only the most likely token
    (and its ties)."""
    probs = torch.softmax(scaled, dim=-1)  # [R, vocab] float32
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [R, 1]
    return scaled.masked_fill(probs < floor, float("-inf"))
# --8<-- [end:min_p]


# --8<-- [start:cut]
def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature-scaled logits [S, vocab] -> the renormalised distribution [S, vocab]
    float64 over the tokens that survive top_k, then top_p. Tied tokens survive or fall
    together.

    A row that asks for no cut (min_p = 0, top_k off, top_p = 1) is a plain softmax;
    only the rows that cut are sorted. Which path a row takes depends on its own
    parameters alone. min_p runs first, as in vLLM.
    """
    S, vocab = scaled.shape
    if min_p is None:
        min_p = torch.zeros_like(top_p)
    probs = torch.softmax(scaled, dim=-1).double()  # [S, vocab]
    cuts = ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)  # [S]
    if bool(cuts.any()):
        rows = cuts.nonzero()[:, 0]  # [R]
        probs[rows] = _cut(scaled[rows], top_k[rows], top_p[rows], min_p[rows])
    return probs / probs.sum(dim=-1, keepdim=True)  # [S, vocab] float64


def _cut(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution [R, vocab] float64 (not yet renormalised) after the min_p,
    top_k and top_p cuts, for rows that ask for at least one of them."""
    R, vocab = scaled.shape
    if min_p is not None:
        scaled = _min_p(scaled, min_p)  # [R, vocab]
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


def _min_ps(metadata: SamplingMetadata) -> torch.Tensor:
    """[S] float32 min_p of each row (None in the metadata: every row's is 0)."""
    if metadata.min_p is None:
        return torch.zeros_like(metadata.temperature)
    return metadata.min_p


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
    if metadata.token_bitmask is not None:  # some row follows a grammar
        logits = apply_token_bitmask(logits, metadata.token_bitmask)  # [S, vocab]
    # --8<-- [end:raw_logprobs]
    if metadata.penalties is not None:  # some row has a penalty or a logit bias
        logits = apply_penalties(logits, metadata.penalties)  # [S, vocab]

    greedy = metadata.temperature < GREEDY_BELOW  # [S]
    greedy_tokens = torch.argmax(logits, dim=-1)  # [S], first index on ties

    token_ids = greedy_tokens.clone()  # [S]
    drawn = (~greedy).nonzero()[:, 0]  # [D] the rows that draw
    if drawn.numel():
        md = metadata
        # [D, vocab]; saturated: penalised logits near float32's largest must not become
        # inf when a small temperature divides them
        scaled = saturate(logits[drawn] / md.temperature[drawn][:, None], logits[drawn])
        probs = _top_k_top_p(scaled, md.top_k[drawn], md.top_p[drawn],
                             _min_ps(md)[drawn])  # [D, vocab]
        # The exponential race: token i wins with probability p_i.
        # [D, vocab] float64
        u = random_uniform(md.streams[drawn], md.positions[drawn], vocab)
        race = probs / -torch.log(u)  # [D, vocab], p / E with E ~ Exp(1)
        token_ids[drawn] = torch.argmax(race, dim=-1)  # [D]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]  # [S]
    top = torch.topk(logprobs, min(metadata.num_logprobs, vocab), dim=-1)  # [S, K] each
    return SamplerOutput(token_ids, chosen, top.values, top.indices)
# --8<-- [end:sample]

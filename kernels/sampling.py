"""The sampler as a Triton kernel: one program per row walks the vocabulary tile by tile.

**What it computes.** Exactly what its twin ``pagedllm.reference.ops.sampling.sample`` computes,
for a batch of next-token logits ``[S, vocab]`` and per-row parameters: blocked tokens (EOS and
stop ids before ``min_tokens``) get -inf, as do the tokens a grammar forbids (structured
outputs: their own kernel, ``token_bitmask.py``, before the penalties'); a greedy row
(temperature below ``GREEDY_BELOW``) takes the argmax of those logits, first index on ties; any
other row divides them by its temperature (saturating at float32's largest number, as the
twin does), takes the softmax in float32, keeps the tokens that survive top-k and top-p,
renormalises in float64 and draws by the *exponential race*: token i
wins when ``p_i / E_i`` is the largest, with ``E_i = -log U_i ~ Exp(1)``. It also reports the
logprob of the chosen token and, when asked, the rows' top-N logprobs, from the log-softmax of
the *raw* logits.

**Why a GPU kernel can reproduce the reference bit for bit.** A stateful generator (torch's
Philox with an offset, curand) hands out numbers in the order threads ask for them, so a kernel
that tiles the vocabulary differently from torch would draw different numbers. Here ``U`` is not
drawn, it is *computed*: a fixed hash (SplitMix64) of (stream, position, token id). Any program
can compute the uniform of any token, in any order, with no state to share or advance. The hash
is integer arithmetic modulo 2**64 — xor, logical shifts, wrapping multiplications — which every
machine does identically: torch does it on int64 words, this kernel on uint64 words (the same
bits, reinterpreted), and the 52 kept bits become a float64 with two exact operations. So the
kernel's ``U`` equals ``random_uniform``'s bit for bit; ``random_uniform`` below exposes the
in-kernel hash so that a test can check every bit.

**Why the race needs no cumulative sum.** Inverse-CDF sampling (draw one ``u``, find where the
cumulative sum crosses it) needs a prefix sum over the whole vocabulary and then a search: two
dependent sweeps and a scan across programs. The race needs only an argmax, and an argmax is a
reduction any tiling can compute: each tile keeps its best ``(value, index)`` and the best of the
bests wins. Ties go to the first index, as in ``torch.argmax``.

**The passes.** A program reads its row four times (a row of 128256 float32 logits is 500 KB,
which the GPU's L2 keeps between passes); each pass is a loop over tiles of ``BLOCK`` tokens:

1. the max of the raw logits (for the logprobs) and the max and first argmax of the blocked
   logits (the greedy token, and the softmax's max after scaling);
2. the two softmax denominators: of the raw logits, and of the scaled logits above the row's
   top-k bound, each ``sum(exp(x - max))`` in float32 as torch's softmax computes it;
   a greedy row stops here;
3. ``mass``, the float64 sum of the kept tokens' float32 probabilities (the twin's
   renormalisation after the cut);
4. the race: ``U`` from the hash, ``(p / mass) / -log(U)`` in float64, and its argmax.

Pass 2 is not an online softmax (one pass with a running max and a rescaled sum): rescaling
rounds differently from the twin's ``exp(x - max)``, and every rounding difference is a chance
for a near-tie in the race to flip. One more read of the row is the cheaper price.

**What runs in torch, and why.** The launcher does three things in torch, each where a kernel
gains nothing or where exact equality demands torch:

- *Which tokens survive top-k and top-p* (only for rows that ask for a cut): the twin's own
  ``_cut`` (a sort, a softmax and a cumulative sum over the sorted row) decides, and the launcher
  reduces its answer to one number per row, the smallest surviving scaled logit, since the
  survivors of both cuts are always the tokens at or above some value. The top-p rule compares a
  float sum with ``top_p``, and knife-edge cases (a token with exactly ``top_p`` of mass above it)
  are decided by float rounding: only the same torch code on the same device decides them the
  same way. A sort is also a poor fit for a row-per-program kernel. The k-th largest value, the
  bound of the twin's float32 softmax for a top-k row, comes from ``torch.topk``.
- *The top-N logprobs*: ``torch.topk`` of the raw logits (log-softmax keeps the order); the
  kernel supplies each row's max and log-denominator, and the launcher subtracts them.
- The fallback: on CPU tensors without ``TRITON_INTERPRET=1``, ``kernel_runner`` returns None and
  the launcher returns the twin's answer.

**How exact is exact.** Everything the kernel does but three things is IEEE arithmetic that
rounds the same everywhere: the hash, the float64 conversion of ``U``, the division by the
temperature (``tl.div_rn``: Triton's ``/`` on float32 is an approximate division on NVIDIA
GPUs), the masking, the maxima, the float64 divisions of the race and the argmax with its tie
rule. Greedy rows are therefore exact, always, and so are tied logits: equal logits give equal
probabilities in both, and the race between them is decided by ``U`` alone. The three things
are ``exp`` and ``log``, whose last bit differs between torch's CPU kernels, numpy (the
interpreter) and CUDA's math library (on a GPU the kernel calls the same ``expf`` and ``log``
as torch's CUDA kernels, through libdevice, rather than Triton's faster approximate ``tl.exp``),
and the order in which the float32 softmax denominator is summed, which torch leaves
unspecified (its CPU sum of 32000 terms is off by about 5e-7, relative, and a cut row's is
summed in sorted order). A drawn row's float32 probabilities can therefore differ from the
twin's in the last bit, about 1e-7 relative, and the drawn token differs only when the race's two
best ``p / E`` are that close: for a random row, a chance of the order of 1e-7. Measured under
the interpreter: 0 mismatches in 30336 drawn rows (vocabularies of 64 to 1000, temperatures
0.3 to 5, with and without cuts), none of them with its two best within 1e-6 of each other.
No formulation removes this while the twin's softmax is float32 torch code (the kernel cannot
reproduce torch's summation order), so the tests demand exact equality of tokens on their cases
and compare logprobs within a tolerance.
"""


import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagedllm.kernels.penalties import apply_penalties, saturate
from pagedllm.kernels.runtime import interpreting, kernel_runner
from pagedllm.kernels.token_bitmask import apply_token_bitmask
from pagedllm.reference.ops.sampling import (
    GOLDEN_GAMMA,
    GREEDY_BELOW,
    MIX_MULTIPLIER_1,
    MIX_MULTIPLIER_2,
    SamplerOutput,
    SamplingMetadata,
    _blocked_mask,
    _cut,
    _min_p,
    _min_ps,
)
from pagedllm.reference.ops.sampling import random_uniform as reference_random_uniform
from pagedllm.reference.ops.sampling import sample as reference_sample
from pagedllm.reference.ops.sampling import saturate as reference_saturate

# The twin holds the constants as int64 wrap-arounds; the kernel works on uint64 words.
_GAMMA = tl.constexpr(GOLDEN_GAMMA % 2**64)
_MIX_1 = tl.constexpr(MIX_MULTIPLIER_1 % 2**64)
_MIX_2 = tl.constexpr(MIX_MULTIPLIER_2 % 2**64)
_TWO_TO_MINUS_52 = tl.constexpr(2.0**-52)  # exact in float32 and float64
_GREEDY_BELOW = tl.constexpr(GREEDY_BELOW)  # compared with the float32 temperature, like torch
_NEG_INF = tl.constexpr(float("-inf"))

MAX_BLOCK = 2048  # the widest tile; tests lower it so that a small vocabulary spans tiles


# --8<-- [start:hash]
@triton.jit
def _mix64(z):
    """SplitMix64's finalizer on uint64 words: * wraps modulo 2**64, >> is logical."""
    z = (z ^ (z >> 30)) * _MIX_1
    z = (z ^ (z >> 27)) * _MIX_2
    return z ^ (z >> 31)


@triton.jit
def _uniform(stream, position, tokens):
    """stream, position: int64 scalars; tokens: int32 block -> U, float64 block in (0, 1).

    The twin's random_uniform, on the int64 bits reinterpreted as uint64.
    """
    a = _mix64(stream.to(tl.uint64, bitcast=True) + _GAMMA)
    b = _mix64(a + (position + 1).to(tl.uint64, bitcast=True) * _GAMMA)
    x = _mix64(b + (tokens.to(tl.uint64) + 1) * _GAMMA)
    return ((x >> 12).to(tl.float64) + 0.5) * _TWO_TO_MINUS_52  # both steps exact
# --8<-- [end:hash]


@triton.jit
def _uniform_kernel(streams_ptr, positions_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    """Row `program_id(0)`, tile `program_id(1)` of U [S, vocab]; only for testing the hash."""
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform(tl.load(streams_ptr + row), tl.load(positions_ptr + row), tokens)
    tl.store(out_ptr + row.to(tl.int64) * vocab + tokens, u, mask=tokens < vocab)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """exp as CUDA's expf/exp, which torch's CUDA kernels call (tl.exp on float32 is the faster,
    less accurate ex2.approx); numpy's exp under the interpreter, which has no libdevice."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """log, as _exp."""
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _blocked(blocked_row_ptr, num_blocked, tokens):
    """True where a token of the tile is one of the row's blocked ids (padding -1 never is)."""
    hit = tokens < 0  # all False
    for j in range(num_blocked):
        hit = hit | (tokens == tl.load(blocked_row_ptr + j))
    return hit


@triton.jit
def _first_argmax(best, best_index, values, tokens):
    """Fold a tile into per-lane running (max, first index). Strictly greater wins, so on ties
    the earlier tile keeps its lane."""
    better = values > best
    return tl.where(better, values, best), tl.where(better, tokens, best_index)


@triton.jit
def _reduce_first_argmax(best, best_index):
    """The lanes' (max, first index) -> the row's max and the smallest index that reaches it."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_index, 2147483647), axis=0)


@triton.jit
def _load_scaled(row_logits, row_blocked, num_blocked, tokens, vocab, temperature):
    """A tile of the row's logits (after the penalties), blocked tokens at -inf, divided by
    the temperature with IEEE rounding and saturated at float32's largest number, as the twin
    does (-inf past the vocabulary)."""
    x = tl.load(row_logits + tokens, mask=tokens < vocab, other=_NEG_INF)
    x = tl.where(_blocked(row_blocked, num_blocked, tokens), _NEG_INF, x)
    return saturate(tl.div_rn(x, temperature), x)


@triton.jit
def _probability(scaled, scaled_max, scaled_sum, LIBDEVICE: tl.constexpr):
    """The float32 softmax probability, as torch computes it: exp(x - max) / sum."""
    return tl.div_rn(_exp(scaled - scaled_max, LIBDEVICE), scaled_sum)


# --8<-- [start:kernel]
@triton.jit
def _sample_kernel(
    logits_ptr,  # [S, vocab] float32 raw logits, rows `stride` apart
    # [S, vocab] float32 after the grammar's mask, logit_bias and the penalties
    # (logits_ptr if none)
    processed_ptr,
    temperature_ptr,  # [S] float32
    streams_ptr, positions_ptr,  # [S] int64 each
    blocked_ptr,  # [S, num_blocked] int64, padded with -1
    # [S] float32: the k-th largest scaled logit, -inf when top-k is off
    topk_bound_ptr,
    # [S] float32: the smallest surviving scaled logit, -inf when nothing is cut
    keep_from_ptr,
    token_ptr,  # out [S] int64
    logprob_ptr, raw_max_ptr, raw_log_sum_ptr,  # out [S] float32 each
    vocab, stride, num_blocked,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # True on a GPU: exp and log from CUDA's math library
):
    row = tl.program_id(0)
    row_logits = logits_ptr + row.to(tl.int64) * stride
    row_processed = processed_ptr + row.to(tl.int64) * stride
    row_blocked = blocked_ptr + row.to(tl.int64) * num_blocked
    temperature = tl.load(temperature_ptr + row)
    lanes = tl.arange(0, BLOCK)

    # Pass 1: max of the raw logits; max and first argmax of the processed, blocked
    # logits.
    raw_max = tl.full([BLOCK], _NEG_INF, tl.float32)
    best = tl.full([BLOCK], _NEG_INF, tl.float32)
    best_index = lanes
    for start in range(0, vocab, BLOCK):
        tokens = start + lanes
        x = tl.load(row_logits + tokens, mask=tokens < vocab, other=_NEG_INF)
        raw_max = tl.maximum(raw_max, x)
        x = tl.load(row_processed + tokens, mask=tokens < vocab, other=_NEG_INF)
        x = tl.where(_blocked(row_blocked, num_blocked, tokens), _NEG_INF, x)
        best, best_index = _first_argmax(best, best_index, x, tokens)
    raw_max = tl.max(raw_max, axis=0)
    blocked_max, token = _reduce_first_argmax(best, best_index)  # the greedy token

    # Pass 2: the softmax denominators, sum(exp(x - max)) in float32. Scaling by a
    # positive temperature keeps the order, so the scaled max is the scaled blocked max.
    drawn = temperature >= _GREEDY_BELOW
    temperature = tl.where(drawn, temperature, 1.0)  # a greedy row's 0 divides nothing
    scaled_max = saturate(tl.div_rn(blocked_max, temperature), blocked_max)
    topk_bound = tl.load(topk_bound_ptr + row)
    raw_sum = tl.zeros([BLOCK], tl.float32)
    scaled_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        tokens = start + lanes
        x = tl.load(row_logits + tokens, mask=tokens < vocab, other=_NEG_INF)
        raw_sum += _exp(x - raw_max, LIBDEVICE)  # exp(-inf) = 0 past the vocabulary
        if drawn:
            scaled = _load_scaled(row_processed, row_blocked, num_blocked, tokens,
                                  vocab, temperature)
            e = _exp(scaled - scaled_max, LIBDEVICE)
            scaled_sum += tl.where(scaled >= topk_bound, e, 0.0)
    raw_log_sum = _log(tl.sum(raw_sum, axis=0), LIBDEVICE)
    scaled_sum = tl.sum(scaled_sum, axis=0)

    if drawn:
        # Pass 3: the float64 mass of the survivors, to renormalise as the twin does.
        keep_from = tl.load(keep_from_ptr + row)
        mass = tl.zeros([BLOCK], tl.float64)
        for start in range(0, vocab, BLOCK):
            tokens = start + lanes
            scaled = _load_scaled(row_processed, row_blocked, num_blocked, tokens,
                                  vocab, temperature)
            p = _probability(scaled, scaled_max, scaled_sum, LIBDEVICE)
            mass += tl.where(scaled >= keep_from, p.to(tl.float64), 0.0)
        mass = tl.sum(mass, axis=0)

        # Pass 4: the exponential race, p / E with E = -log U, and its first argmax.
        stream = tl.load(streams_ptr + row)
        position = tl.load(positions_ptr + row)
        race_best = tl.full([BLOCK], _NEG_INF, tl.float64)
        race_index = lanes
        for start in range(0, vocab, BLOCK):
            tokens = start + lanes
            scaled = _load_scaled(row_processed, row_blocked, num_blocked, tokens,
                                  vocab, temperature)
            p = _probability(scaled, scaled_max, scaled_sum, LIBDEVICE)
            # renormalised
            p = tl.where(scaled >= keep_from, p.to(tl.float64), 0.0) / mass
            race = p / -_log(_uniform(stream, position, tokens), LIBDEVICE)  # p / E
            # lanes past the end never win
            race = tl.where(tokens < vocab, race, _NEG_INF)
            race_best, race_index = _first_argmax(race_best, race_index, race, tokens)
        _, token = _reduce_first_argmax(race_best, race_index)

    chosen = tl.load(row_logits + token)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, (chosen - raw_max) - raw_log_sum)
    tl.store(raw_max_ptr + row, raw_max)
    tl.store(raw_log_sum_ptr + row, raw_log_sum)
# --8<-- [end:kernel]


def _block(vocab: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(vocab, 1)))


def random_uniform(streams: torch.Tensor, positions: torch.Tensor,
                   vocab_size: int) -> torch.Tensor:
    """The in-kernel hash, written out: streams [S], positions [S] int64 -> U [S, vocab] float64.

    Same signature and bits as the twin's ``random_uniform``; it exists so that tests can hold
    the kernel's hash to the twin's, bit for bit.
    """
    runner = kernel_runner(_uniform_kernel, streams, positions)
    if runner is None:
        return reference_random_uniform(streams, positions, vocab_size)
    S = streams.shape[0]
    out = torch.empty(S, vocab_size, dtype=torch.float64, device=streams.device)
    block = _block(vocab_size)
    if S and vocab_size:
        runner[(S, triton.cdiv(vocab_size, block))](
            streams.long().contiguous(), positions.long().contiguous(), out, vocab_size,
            BLOCK=block)
    return out


def _cut_bounds(logits: torch.Tensor,
                metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-row numbers the kernel needs from top-k and top-p, both float32 [S]:

    - the softmax bound: the twin's float32 softmax of a cut row runs over the tokens at or
      above it, those that survive min_p and top-k (the k-th largest scaled logit after
      min_p, or min_p's smallest survivor, whichever is larger);
    - keep-from, the smallest scaled logit the twin gives a nonzero probability after both cuts:
      exactly the tokens at or above it survive (with any probability that matters).

    Both are -inf for rows that cut nothing (and for greedy rows). The decision is the twin's
    own ``_cut``, on scaled logits computed by the same torch operations as in the twin, so the
    same tokens survive even where float rounding decides (top_p exactly at a token's mass).
    """
    S, vocab = logits.shape
    md = metadata
    topk_bound = torch.full((S,), float("-inf"), device=logits.device)
    keep_from = torch.full((S,), float("-inf"), device=logits.device)
    has_k = (md.top_k > 0) & (md.top_k < vocab)  # [S]
    min_p = _min_ps(md)  # [S]
    cuts = (md.temperature >= GREEDY_BELOW) & (has_k | (md.top_p < 1) | (min_p > 0))  # [S]
    if not bool(cuts.any()):
        return topk_bound, keep_from
    rows = cuts.nonzero()[:, 0]  # [R]
    blocked = _blocked_mask(md.blocked_token_ids[rows], vocab)  # [R, vocab]
    masked = logits[rows].masked_fill(blocked, float("-inf"))  # [R, vocab]
    scaled = reference_saturate(masked / md.temperature[rows][:, None], masked)
    # [R, vocab] float64, the twin's rule
    probs = _cut(scaled, md.top_k[rows], md.top_p[rows], min_p[rows])
    keep_from[rows] = torch.where(probs > 0, scaled, float("inf")).amin(dim=-1)
    survivors = _min_p(scaled, min_p[rows])  # [R, vocab], -inf where min_p drops
    min_p_from = torch.where(survivors > float("-inf"), scaled, float("inf")).amin(dim=-1)
    k = torch.where(has_k[rows], md.top_k[rows], 1)  # [R]
    kth = torch.topk(survivors, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])[:, 0]
    kth = torch.where(has_k[rows], kth, float("-inf"))
    topk_bound[rows] = torch.maximum(kth, torch.where(min_p[rows] > 0, min_p_from,
                                                      float("-inf")))
    return topk_bound, keep_from


# --8<-- [start:launcher]
def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """logits [S, vocab] -> one token per row, its logprob and the rows' top logprobs.

    The twin's signature and answer; see the module docstring for what runs where.
    """
    md = metadata
    runner = kernel_runner(_sample_kernel, logits, md.temperature, md.top_k, md.top_p,
                           md.streams, md.positions, md.blocked_token_ids)
    if runner is None:
        return reference_sample(logits, metadata)
    logits = logits.float().contiguous()  # bf16/fp16 logits upcast, as the twin does
    processed = logits  # a grammar's bitmask, logit_bias and the penalties: their own kernels
    if md.token_bitmask is not None:  # structured outputs (token_bitmask.py)
        processed = apply_token_bitmask(processed, md.token_bitmask)
    if md.penalties is not None:  # penalties.py
        processed = apply_penalties(processed, md.penalties).contiguous()
    S, vocab = logits.shape
    device = logits.device
    token_ids = torch.zeros(S, dtype=torch.int64, device=device)
    chosen = torch.empty(S, dtype=torch.float32, device=device)
    raw_max = torch.empty(S, dtype=torch.float32, device=device)
    raw_log_sum = torch.empty(S, dtype=torch.float32, device=device)
    if S and vocab:
        topk_bound, keep_from = _cut_bounds(processed, md)
        blocked = md.blocked_token_ids.long().contiguous()  # [S, M]
        num_blocked = blocked.shape[1]
        if num_blocked == 0:  # never read; a real pointer all the same
            blocked = torch.full((1,), -1, dtype=torch.int64, device=device)
        block = _block(vocab)
        compiled = {} if interpreting() else {"num_warps": 8 if block >= 1024 else 4}
        runner[(S,)](
            logits, processed, md.temperature.float().contiguous(), md.streams.long().contiguous(),
            md.positions.long().contiguous(), blocked, topk_bound, keep_from,
            token_ids, chosen, raw_max, raw_log_sum,
            vocab, logits.stride(0), num_blocked,
            BLOCK=block, LIBDEVICE=logits.is_cuda and not interpreting(), **compiled,
        )
    top = torch.topk(logits, min(md.num_logprobs, vocab), dim=-1)  # [S, K], largest first
    top_logprobs = (top.values - raw_max[:, None]) - raw_log_sum[:, None]
    return SamplerOutput(token_ids, chosen, top_logprobs, top.indices)
# --8<-- [end:launcher]

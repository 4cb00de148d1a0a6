// Decode attention over the paged KV cache, read in place: one query row per sequence.
// Beside kernels/paged_attention.py (Triton); twin: reference/ops/attention.py
// (paged_attention).

#include "cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace pagedllm_cpu;

namespace {


// e^x for x <= 0, 16 at a time: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor
// polynomial to r^6 (relative error under 2^-22, below the bf16 rounding of the result),
// times 2^n. x is clamped at -87 (e^-87 is nothing beside the peak's 1); a NaN stays NaN
// (max_ps returns its second operand when one is NaN), so a NaN or infinite key gives a
// NaN head, as the definition does.
AVX512BF16 static inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})  // Horner
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// The 16 sums of 16 float32 vectors, as one vector (lane i: the sum of a[i]): a tree of
// shuffles and adds, 46 instructions where 16 reductions take about 130.
AVX512BF16 static inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: b[i] = partials of a[i] | of a[i + 8]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44),
                         _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: a[i], a[i + 8], a[i + 4], a[i + 12]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // within each quarter: pairs of c[i] and c[i + 2]
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
  const __m512 f = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))));
  // f's lane k holds the sum of a[order[k]]; order is its own inverse
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, f);
}

// The softmax-weighted sum of the values for NG query heads that read one KV head: each
// value row is widened to float32 once and serves every head.
template <int NG>
AVX512BF16 void weighted_values(const uint16_t* v, const int64_t* slots, int64_t n,
                                int64_t row_stride, int64_t D, const float* p, int64_t p_stride,
                                const float* inv_total, uint16_t* out) {
  __m512 o[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 4; ++j) o[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* vt = v + slots[t] * row_stride;
    for (int j = 0; j < 4; ++j) {
      if (j * 16 >= D) break;
      const __m512 vd = widen(_mm256_loadu_si256((const __m256i*)(vt + j * 16)));
      for (int g = 0; g < NG; ++g)
        o[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride + t]), vd, o[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256((__m256i*)(out + g * D + d), (__m256i)_mm512_cvtneps_pbh(
          _mm512_mul_ps(o[g][d / 16], _mm512_set1_ps(inv_total[g]))));
}

// Decode attention of the G query heads that read one KV head (q, out: [G, D] contiguous)
// over positions first..len-1 of one sequence. slots [n] and scores [G, n] are scratch.
AVX512BF16 void decode_group(const uint16_t* q, int64_t G, const uint16_t* k, const uint16_t* v,
                             const int32_t* table, int64_t first, int64_t len, int64_t bs,
                             int64_t row_stride, int64_t D, float scale, int64_t* slots,
                             float* scores, uint16_t* out) {
  const int64_t n = len - first;
  for (int64_t t = first; t < len;) {  // each position's slot, a block at a time
    const int64_t b = t / bs, end = std::min(len, (b + 1) * bs);
    for (const int64_t base = (int64_t)table[b] * bs - b * bs; t < end; ++t)
      slots[t - first] = base + t;
  }
  std::vector<float> inv_total(G);
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* qg = q + g * D;
    float* sg = scores + g * n;
    // scores q . k_t, 16 keys at a time, their 16 dot products summed by one tree
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      __m512 acc[16];
      const int64_t live = std::min<int64_t>(16, n - t0);
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j >= live) continue;
        const uint16_t* kt = k + slots[t0 + j] * row_stride;
        for (int64_t d = 0; d < D; d += 32)
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512((const void*)(qg + d)),
                                    (__m512bh)_mm512_loadu_si512((const void*)(kt + d)));
      }
      _mm512_mask_storeu_ps(sg + t0, (__mmask16)((1u << live) - 1),
                            _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
    __m512 peak16 = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
      peak16 = _mm512_mask_max_ps(peak16, m, peak16, _mm512_maskz_loadu_ps(m, sg + i));
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(peak16));
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + i), peak));
      _mm512_mask_storeu_ps(sg + i, m, e);
      total16 = _mm512_add_ps(total16, _mm512_maskz_mov_ps(m, e));
    }
    inv_total[g] = 1.f / _mm512_reduce_add_ps(total16);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // four heads' sums in registers at a time
    const float* p = scores + g0 * n;
    switch (std::min<int64_t>(4, G - g0)) {
#define HEADS(NG) case NG: \
  weighted_values<NG>(v, slots, n, row_stride, D, p, n, &inv_total[g0], out + g0 * D); break;
      HEADS(1) HEADS(2) HEADS(3) HEADS(4)
#undef HEADS
    }
  }
}

}  // namespace

// Decode attention over a paged bf16 cache: one query row per sequence, read in place.
// q [S, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [S, W] int32;
// seq_lens [S] int64. Query head h reads KV head h / (H / Hkv). Scores, softmax and the
// weighted sum in float32, rounded once to bf16; window > 0 keeps the last `window` keys.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(isa() == Isa::avx512, "paged_decode_attention has no path for ", isa_name(isa()));
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.is_contiguous(),
              "q must be a contiguous [S, heads, head_dim] bfloat16 tensor");
  TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16 &&
              v_cache.scalar_type() == torch::kBFloat16 && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "the caches must be contiguous bfloat16 [blocks, block_size, kv_heads, D]");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 64 && k_cache.size(3) == D && H % Hkv == 0,
              "head_dim must be 32 or 64, heads a multiple of the KV heads");
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(tables.size(0) >= S && lens.size(0) >= S, "a table and a length per query");
  auto out = torch::empty_like(q);
  const int64_t W = tables.size(1), group = H / Hkv;
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  const uint16_t* kp = (const uint16_t*)k_cache.data_ptr();
  const uint16_t* vp = (const uint16_t*)v_cache.data_ptr();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, S * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<int64_t> slots;
    for (int64_t i = i0; i < i1; ++i) {  // sequence s, KV head j and its query heads
      const int64_t s = i / Hkv, j = i % Hkv, len = lp[s];
      TORCH_CHECK(len >= 1 && len <= W * bs, "sequence ", s, " has length ", len,
                  "; its block table holds ", W * bs, " positions");
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t b = first / bs; b <= (len - 1) / bs; ++b)  // reads stay inside the cache
        TORCH_CHECK(tp[s * W + b] >= 0 && tp[s * W + b] < blocks, "sequence ", s,
                    "'s block table names block ", tp[s * W + b], " of ", blocks);
      slots.resize(len - first);
      scores.resize(group * (len - first));
      const int64_t head = s * H + j * group;  // the group's first query head
      decode_group(qp + head * D, group, kp + j * D, vp + j * D, tp + s * W, first, len, bs,
                   Hkv * D, D, (float)scale, slots.data(), scores.data(), op + head * D);
    }
  });
  return out;
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}

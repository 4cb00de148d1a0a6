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

// Softmax numerics, the same on every path: scores, their peak, e^(score - peak), the total
// and the weighted sum of the values in float32, rounded once to the output's dtype. e^x (x <=
// 0) is exp_neg below, one polynomial on every path (AVX-512 16 values at a time, AVX2 8, the
// scalar path 1): x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial to r^6
// (relative error under 2^-22, below the bf16 rounding of the result), times 2^n. x is clamped
// at -87 (e^-87 is nothing beside the peak's 1); a NaN stays NaN, so a NaN or infinite key
// gives a NaN head (through the total), as the definition does. The scalar path rounds its
// Horner steps twice where the vector paths fuse them (an FMA): last-bit differences.
constexpr float LOG2E = 1.44269504f, LN2_HI = 0.693145752f, LN2_LO = 1.42860677e-6f;
constexpr float TAYLOR[] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // after 1 / 720

inline float exp_neg1(float x) {
  if (x != x) return x;
  x = std::max(-87.f, x);
  const float n = std::nearbyint(x * LOG2E);
  const float r = (x - n * LN2_HI) - n * LN2_LO;  // ln 2 in two parts
  float p = 1.f / 720;
  for (float c : TAYLOR) p = p * r + c;  // Horner
  return std::ldexp(p, (int)n);
}

// --8<-- [start:scalar]
// The positions first..len-1 of a sequence as slots of the cache: its block table's
// entry for each position's block, then the offset in the block.
void fill_slots(const int32_t* table, int64_t first, int64_t len, int64_t bs,
                int64_t* slots) {
  for (int64_t t = first; t < len;) {  // a block at a time
    const int64_t b = t / bs, end = std::min(len, (b + 1) * bs);
    for (const int64_t base = (int64_t)table[b] * bs - b * bs; t < end; ++t)
      slots[t - first] = base + t;
  }
}

// Decode attention of the G query heads that read one KV head (q, out: [G, D]
// contiguous) over the n keys and values at slots[0..n) (rows of row_stride values);
// scores [G, n] is scratch. The scalar path: each head on its own, one value at a time.
template <class T>
void decode_group_scalar(const T* q, int64_t G, const T* k, const T* v,
                         const int64_t* slots, int64_t n, int64_t row_stride, int64_t D,
                         float scale, float* scores, T* out) {
  std::vector<float> o(D);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * D;
    float* sg = scores + g * n;
    float peak = -INFINITY;
    for (int64_t t = 0; t < n; ++t) {
      const T* kt = k + slots[t] * row_stride;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += load1(qg + d) * load1(kt + d);
      sg[t] = dot * scale;
      // a NaN score is not the peak: it reaches the total
      peak = std::max(peak, sg[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) total += sg[t] = exp_neg1(sg[t] - peak);
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const T* vt = v + slots[t] * row_stride;
      for (int64_t d = 0; d < D; ++d) o[d] += sg[t] * load1(vt + d);
    }
    const float inv_total = 1.f / total;
    for (int64_t d = 0; d < D; ++d) store1(out + g * D + d, o[d] * inv_total);
  }
}
// --8<-- [end:scalar]

#ifdef PAGEDLLM_X86
// ---- AVX2 and FMA: 8 values a register, 16 registers ----

AVX2FMA static inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // max returns its second operand if NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (float c : TAYLOR) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  // 2^n as a float's exponent field: n >= -126 (x >= -87), a normal number
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The 8 sums of 8 float32 vectors as one vector (lane i: the sum of a[i]): horizontal adds
// pair them up, then the two 128-bit halves meet.
AVX2FMA static inline __m256 sum8(const __m256* a) {
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20),
                       _mm256_permute2f128_ps(c0, c1, 0x31));
}

// The softmax-weighted sum of the values for NG query heads that read one KV head: each
// value row is loaded (widened) once and serves every head. D <= 64: 8 registers a head.
template <int NG, class T>
AVX2FMA void weighted_values_avx2(const T* v, const int64_t* slots, int64_t n,
                                  int64_t row_stride, int64_t D, const float* p,
                                  int64_t p_stride, const float* inv_total, T* out) {
  __m256 o[NG][8];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 8; ++j) o[g][j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + slots[t] * row_stride;
    for (int j = 0; j < 8; ++j) {
      if (j * 8 >= D) break;
      const __m256 vd = load8(vt + j * 8);
      for (int g = 0; g < NG; ++g)
        o[g][j] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * p_stride + t]), vd, o[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int64_t d = 0; d < D; d += 8)
      store8(out + g * D + d, _mm256_mul_ps(o[g][d / 8], _mm256_set1_ps(inv_total[g])));
}

// --8<-- [start:avx2]
template <class T>
AVX2FMA void decode_group_avx2(const T* q, int64_t G, const T* k, const T* v,
                               const int64_t* slots, int64_t n, int64_t row_stride,
                               int64_t D, float scale, float* scores, T* out) {
  std::vector<float> inv_total(G);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * D;
    float* sg = scores + g * n;
    // scores q . k_t, 8 keys at a time, their 8 dot products summed by one tree
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      __m256 acc[8];
      const int64_t live = std::min<int64_t>(8, n - t0);
      for (int j = 0; j < 8; ++j) {
        acc[j] = _mm256_setzero_ps();
        if (j >= live) continue;
        const T* kt = k + slots[t0 + j] * row_stride;
        for (int64_t d = 0; d < D; d += 8)
          acc[j] = _mm256_fmadd_ps(load8(qg + d), load8(kt + d), acc[j]);
      }
      alignas(32) float dots[8];
      _mm256_store_ps(dots, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
      std::copy(dots, dots + live, sg + t0);
    }
    float peak = -INFINITY;  // a NaN score is not the peak: it reaches the total
    for (int64_t t = 0; t < n; ++t) peak = std::max(peak, sg[t]);
    __m256 total8 = _mm256_setzero_ps();
    float total = 0.f;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e =
          exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(peak)));
      _mm256_storeu_ps(sg + t, e);
      total8 = _mm256_add_ps(total8, e);
    }
    for (; t < n; ++t) total += sg[t] = exp_neg1(sg[t] - peak);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, total8);
    for (float lane : lanes) total += lane;
    inv_total[g] = 1.f / total;
  }
  for (int64_t g0 = 0; g0 < G; g0 += 2) {  // two heads' sums in registers at a time
    const float* p = scores + g0 * n;
    T* o = out + g0 * D;
    if (G - g0 >= 2)
      weighted_values_avx2<2>(v, slots, n, row_stride, D, p, n, &inv_total[g0], o);
    else
      weighted_values_avx2<1>(v, slots, n, row_stride, D, p, n, &inv_total[g0], o);
  }
}
// --8<-- [end:avx2]

// ---- AVX-512: 16 values a register, 32 registers; bf16 dot products in vdpbf16ps ----

AVX512BF16 static inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);  // max returns its second operand if NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : TAYLOR) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));  // Horner
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

// acc + the products of 32 values of q and k: bf16 pairs in one vdpbf16ps, float32 in two
// FMAs
AVX512BF16 static inline __m512 dot32(__m512 acc, const uint16_t* q, const uint16_t* k) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void*)q),
                          (__m512bh)_mm512_loadu_si512((const void*)k));
}
AVX512BF16 static inline __m512 dot32(__m512 acc, const float* q, const float* k) {
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k), acc);
  return _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(k + 16), acc);
}

// The softmax-weighted sum of the values for NG query heads that read one KV head: each
// value row is loaded (widened) once and serves every head. D <= 64: 4 registers a head.
template <int NG, class T>
AVX512BF16 void weighted_values_avx512(const T* v, const int64_t* slots, int64_t n,
                                       int64_t row_stride, int64_t D, const float* p,
                                       int64_t p_stride, const float* inv_total, T* out) {
  __m512 o[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 4; ++j) o[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + slots[t] * row_stride;
    for (int j = 0; j < 4; ++j) {
      if (j * 16 >= D) break;
      const __m512 vd = load16(vt + j * 16);
      for (int g = 0; g < NG; ++g)
        o[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride + t]), vd, o[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int64_t d = 0; d < D; d += 16)
      store16(out + g * D + d, _mm512_mul_ps(o[g][d / 16], _mm512_set1_ps(inv_total[g])));
}

template <class T>
AVX512BF16 void decode_group_avx512(const T* q, int64_t G, const T* k, const T* v,
                                    const int64_t* slots, int64_t n, int64_t row_stride,
                                    int64_t D, float scale, float* scores, T* out) {
  std::vector<float> inv_total(G);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * D;
    float* sg = scores + g * n;
    // scores q . k_t, 16 keys at a time, their 16 dot products summed by one tree
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      __m512 acc[16];
      const int64_t live = std::min<int64_t>(16, n - t0);
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j >= live) continue;
        const T* kt = k + slots[t0 + j] * row_stride;
        for (int64_t d = 0; d < D; d += 32) acc[j] = dot32(acc[j], qg + d, kt + d);
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
      const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + i), peak));
      _mm512_mask_storeu_ps(sg + i, m, e);
      total16 = _mm512_add_ps(total16, _mm512_maskz_mov_ps(m, e));
    }
    inv_total[g] = 1.f / _mm512_reduce_add_ps(total16);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // four heads' sums in registers at a time
    const float* p = scores + g0 * n;
    switch (std::min<int64_t>(4, G - g0)) {
#define HEADS(NG) case NG: weighted_values_avx512<NG>(v, slots, n, row_stride, D, p, n, \
                                                       &inv_total[g0], out + g0 * D); break;
      HEADS(1) HEADS(2) HEADS(3) HEADS(4)
#undef HEADS
    }
  }
}
#endif

}  // namespace

// Decode attention over a paged bf16 or float32 cache: one query row per sequence, read in
// place. q [S, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D] of q's dtype;
// block_tables [S, W] int32; seq_lens [S] int64. Query head h reads KV head h / (H / Hkv).
// Scores, softmax and the weighted sum in float32, rounded once to q's dtype; window > 0
// keeps the last `window` keys.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == at::kBFloat16 || dtype == at::kFloat) &&
              q.is_contiguous(),
              "q must be a contiguous [S, heads, head_dim] bfloat16 or float32 tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "the caches must be contiguous [blocks, block_size, kv_heads, D] of q's dtype");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 64 && k_cache.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "head_dim must be 32 or 64, heads a multiple of the KV heads");
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) >= S && lens.size(0) >= S,
              "a table and a length per query");
  auto out = at::empty_like(q);
  const int64_t W = tables.size(1), group = H / Hkv;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const Isa path = isa();  // read once: every thread takes the same path
  with_rows(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    auto group_kernel = decode_group_scalar<T>;
#ifdef PAGEDLLM_X86
    if (path >= Isa::avx512) group_kernel = decode_group_avx512<T>;
    else if (path == Isa::avx2) group_kernel = decode_group_avx2<T>;
#endif
    const T* qp = (const T*)q.data_ptr();
    const T* kp = (const T*)k_cache.data_ptr();
    const T* vp = (const T*)v_cache.data_ptr();
    T* op = (T*)out.data_ptr();
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
        fill_slots(tp + s * W, first, len, bs, slots.data());
        const int64_t head = s * H + j * group;  // the group's first query head
        group_kernel(qp + head * D, group, kp + j * D, vp + j * D, slots.data(), len - first,
                     Hkv * D, D, (float)scale, scores.data(), op + head * D);
      }
    });
  });
  return out;
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}

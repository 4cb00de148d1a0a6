// The optimized tier's CPU kernels for bf16 on AVX-512 BF16 (cpu_ops.py says why each):
// few-row matrix products, decode attention over the paged cache, RMSNorm, the K/V write
// and rotary, registered as torch operators (torch.ops.pagedllm_cpu.*).
//
// The products: x [M, K] bf16 times a weight held as int4 codes with a scale and zero
// point per group (W4A16) or as bf16, -> [M, N] bf16. A decode step multiplies a few rows
// by every weight, so it is as fast as the weights can be read. The codes become bf16
// inside the registers, never written back as a float weight, and are multiplied with
// vdpbf16ps: per 32-bit lane, two bf16 products added to a float32 accumulator. A 512-bit
// register then holds 16 outputs x 2 inputs, the layout the weights are packed in
// (cpu_ops.py): per block of 16 outputs, the inputs in pairs.
//
// int4 codes q in [0, 15] stand for (q - 8) s + z in their group. 0x4300 | q is the bf16
// bit pattern of 128 + q (bf16 keeps 7 mantissa bits), so one OR turns a code into a bf16
// number, and a group's products sum to D = sum x (128 + q). With X = sum x over the group,
//     sum x w = s sum x q + (z - 8 s) X = s D + (z - 136 s) X,
// so the kernel adds X (z - 136 s) to s D: three FMAs a group. Scales and zero points stay
// in bf16, as the twin stores them.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma")))

namespace {

AVX512BF16 static inline __m512 widen(__m256i bits) {  // 16 bf16 -> 16 float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
AVX512BF16 static inline __m256i narrow(__m512 v) {  // 16 float32 -> 16 bf16, nearest even
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// --8<-- [start:int4_tile]
// MB rows x 16 outputs of the int4 product; xs holds each row's sum over each group.
template <int MB>
AVX512BF16 void int4_tile(const uint16_t* x, int64_t K, const uint8_t* w,
                          const uint16_t* scale, const uint16_t* zero, const float* xs,
                          int64_t G, int64_t gs, uint16_t* out, int64_t N) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  for (int64_t g = 0; g < G; ++g) {
    // A few rows: two sums a row (low and high nibbles), so that a product waits only
    // for every other one. Eight rows keep the registers busy with one sum a row.
    constexpr bool split = MB <= 4;
    __m512 dot[MB], dot_hi[MB];
    for (int m = 0; m < MB; ++m) dot[m] = dot_hi[m] = _mm512_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
      // 32 bytes: low nibbles hold inputs k, k+1 of the 16 outputs, high ones k+2, k+3
      __m512i b = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256((const __m256i*)(w + k * 8)));
      __m512bh lo =
          (__m512bh)_mm512_or_si512(_mm512_and_si512(b, low4), bf16_128);
      __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), bf16_128);
      for (int m = 0; m < MB; ++m) {
        // inputs k..k+3 of row m as two pairs, each pair broadcast to every lane
        const int32_t* xr = (const int32_t*)(x + m * K + k);
        dot[m] = _mm512_dpbf16_ps(dot[m], lo, (__m512bh)_mm512_set1_epi32(xr[0]));
        __m512& sum_hi = split ? dot_hi[m] : dot[m];
        sum_hi = _mm512_dpbf16_ps(sum_hi, hi, (__m512bh)_mm512_set1_epi32(xr[1]));
      }
    }
    const __m512 s = _mm512_cvtpbh_ps(
        (__m256bh)_mm256_loadu_si256((const __m256i*)(scale + g * 16)));
    const __m512 z = _mm512_fmadd_ps(  // z - 136 s
        _mm512_set1_ps(-136.f), s,
        _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(zero + g * 16)))
    );
    for (int m = 0; m < MB; ++m) {
      const __m512 d = split ? _mm512_add_ps(dot[m], dot_hi[m]) : dot[m];
      acc[m] = _mm512_fmadd_ps(d, s, acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), z, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m)  // round once to bf16
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}
// --8<-- [end:int4_tile]

// MB rows x 16 outputs of the bf16 product.
template <int MB>
AVX512BF16 void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* out,
                          int64_t N) {
  __m512 acc[MB], acc_odd[MB];  // two sums a row, even and odd input pairs
  for (int m = 0; m < MB; ++m) acc[m] = acc_odd[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + k * 16));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(w + k * 16 + 32));
    for (int m = 0; m < MB; ++m) {
      const int32_t* xr = (const int32_t*)(x + m * K + k);
      acc[m] = _mm512_dpbf16_ps(acc[m], w0, (__m512bh)_mm512_set1_epi32(xr[0]));
      acc_odd[m] = _mm512_dpbf16_ps(acc_odd[m], w1, (__m512bh)_mm512_set1_epi32(xr[1]));
    }
  }
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_add_ps(acc[m], acc_odd[m]);
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

// --8<-- [start:int8_tile]
// MB rows x 16 outputs of the int8 product (W8A16) on VNNI. vpdpbusd multiplies 4
// unsigned bytes by 4 signed bytes per 32-bit lane and adds the 4 products to an int32.
// The codes are the signed bytes, as stored: four inputs of one output a lane. The rows
// are the unsigned bytes: each row as 24-bit integers X = x 2^(23 - e), 2^e above the
// row's largest |x|, cut into three byte planes, X = A0 + 2^8 A1 + 2^16 (A2 - 128).
// bf16 has 8 significant bits: every x within 2^16 of the row's largest is an integer
// there, exactly; a smaller one is rounded by at most 2^(e - 24), as float32 would.
// sum q X = P0 + 2^8 P1 + 2^16 (P2 - 128 sum q): three int32 sums, no code converted,
// and y = s 2^(e - 23) sum q X, rounded once to bf16.
template <int MB>
AVX512BF16 __attribute__((always_inline)) static inline void int8_step(
    __m512i (*acc)[3], const uint8_t* planes, int64_t K, const int8_t* w, int64_t k) {
  // inputs k..k+3 of 16 outputs, into the sums of every row m and plane p
  const __m512i wk = _mm512_loadu_si512((const void*)(w + k * 16));
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < 3; ++p) {
      int32_t four;  // the row's plane p at inputs k..k+3
      std::memcpy(&four, planes + (m * 3 + p) * K + k, 4);
      acc[m][p] = _mm512_dpbusd_epi32(acc[m][p], _mm512_set1_epi32(four), wk);
    }
}

template <int MB>
AVX512BF16 void int8_tile(const uint8_t* planes, int64_t K, const int8_t* w,
                          const float* scale, const int32_t* qsum,
                          const float* row_scale, uint16_t* out, int64_t N) {
  constexpr int C = MB <= 2 ? 2 : 1;  // sums a plane: few rows keep more in flight
  __m512i acc[C][MB][3];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < MB; ++m)
      for (int p = 0; p < 3; ++p) acc[c][m][p] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 4 * C <= K; k += 4 * C)
    for (int c = 0; c < C; ++c) int8_step<MB>(acc[c], planes, K, w, k + 4 * c);
  for (; k < K; k += 4) int8_step<MB>(acc[0], planes, K, w, k);
  const __m512 s = _mm512_loadu_ps(scale);
  const __m512i q128 = _mm512_slli_epi32(_mm512_loadu_si512((const void*)qsum), 7);
  for (int m = 0; m < MB; ++m) {
    __m512i p0 = acc[0][m][0], p1 = acc[0][m][1], p2 = acc[0][m][2];
    for (int c = 1; c < C; ++c) {
      p0 = _mm512_add_epi32(p0, acc[c][m][0]);
      p1 = _mm512_add_epi32(p1, acc[c][m][1]);
      p2 = _mm512_add_epi32(p2, acc[c][m][2]);
    }
    __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(p2, q128));  // P2 - 128 sum q
    sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(p1));
    sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(p0));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(sum, s), _mm512_set1_ps(row_scale[m]));
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(y));
  }
}
// --8<-- [end:int8_tile]

// Four or more rows: vpdpbusd takes two cycles on this CPU (AMD Zen 4) and each row needs
// three, so from four rows on it is cheaper to turn the codes into bf16 once (exact: eight
// bits) and multiply every row with vdpbf16ps, as int4_tile does. From the same layout:
// lane n holds the codes of output n for inputs k..k+3, c_j = its byte j sign-extended,
// and the two bf16 operands are (c_0, c_1) and (c_2, c_3), each a float32's top half.
AVX512BF16 static inline void int8_lane_pairs(__m512i lane, __m512bh* p01, __m512bh* p23) {
  const __m512 c0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lane, 24), 24));
  const __m512 c1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lane, 16), 24));
  const __m512 c2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lane, 8), 24));
  const __m512 c3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(lane, 24));
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  // low half: c_even's top 16 bits; high half: c_odd's (imm 0xF8: A | (B & C))
  *p01 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(c0), 16),
                                             _mm512_castps_si512(c1), high, 0xF8);
  *p23 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(c2), 16),
                                             _mm512_castps_si512(c3), high, 0xF8);
}

template <int MB>
AVX512BF16 void int8_bf16_tile(const uint16_t* x, int64_t K, const int8_t* w,
                               const float* scale, uint16_t* out, int64_t N) {
  __m512 acc[MB], acc_odd[MB];  // inputs (k, k+1) and (k+2, k+3): two sums a row
  for (int m = 0; m < MB; ++m) acc[m] = acc_odd[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    __m512bh p01, p23;
    int8_lane_pairs(_mm512_loadu_si512((const void*)(w + k * 16)), &p01, &p23);
    for (int m = 0; m < MB; ++m) {
      int32_t xr[2];  // inputs (k, k+1) and (k+2, k+3) of row m, as bf16 pairs
      std::memcpy(xr, x + m * K + k, 8);
      acc[m] = _mm512_dpbf16_ps(acc[m], p01, (__m512bh)_mm512_set1_epi32(xr[0]));
      acc_odd[m] = _mm512_dpbf16_ps(acc_odd[m], p23, (__m512bh)_mm512_set1_epi32(xr[1]));
    }
  }
  const __m512 s = _mm512_loadu_ps(scale);
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(
        _mm512_mul_ps(_mm512_add_ps(acc[m], acc_odd[m]), s)));
}

constexpr int64_t kRows = 8;  // rows a tile keeps in registers: 2 x 8 accumulators of 16 floats

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous [M, K] bfloat16 tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs; the weight takes ", K);
}

}  // namespace

bool supported() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
}

// packed [N/16, K/4, 32] uint8; scales, zeros [N/16, G, 16] bf16
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          int64_t group_size) {
  const int64_t NB = packed.size(0), K = packed.size(1) * 4, N = NB * 16, G = K / group_size;
  check_x(x, K);
  TORCH_CHECK(group_size % 4 == 0 && K % group_size == 0 && scales.numel() == NB * G * 16 &&
              zeros.numel() == NB * G * 16 && packed.is_contiguous() &&
              scales.is_contiguous() && zeros.is_contiguous(),
              "int4_matmul takes cpu_ops.pack_int4's tensors");
  const int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  std::vector<float> xs(M * G);  // [M, G]: each row's sum over each group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        uint32_t bits = (uint32_t)xp[m * K + k] << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        sum += v;
      }
      xs[m * G + g] = sum;
    }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && zeros.scalar_type() ==
              torch::kBFloat16, "int4 scales and zero points are bf16");
  const uint16_t* sp = (const uint16_t*)scales.data_ptr();
  const uint16_t* zp = (const uint16_t*)zeros.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const uint16_t* xm = xp + m0 * K;
        const float* xsm = xs.data() + m0 * G;
        const uint8_t* w = wp + nb * K * 8;
        const uint16_t *s = sp + nb * G * 16, *z = zp + nb * G * 16;
        uint16_t* o = op + m0 * N + nb * 16;
        switch (std::min(kRows, M - m0)) {
#define TILE(R) case R: int4_tile<R>(xm, K, w, s, z, xsm, G, group_size, o, N); break;
          TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
        }
      }
  });
  return out;
}

// Each row as int8_tile's three byte planes [3, K] and its scale 2^(e - 23). A row with a
// value that is not finite gives NaN outputs (the planes cannot hold it). K % 16 == 0.
AVX512BF16 static void int8_planes(const uint16_t* x, int64_t M, int64_t K, uint8_t* planes,
                                   float* row_scale) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * K;
    __m512 peak = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {  // max |x|, and whether any is NaN
      const __m512 v = widen(_mm256_loadu_si256((const __m256i*)(xr + k)));
      peak = _mm512_max_ps(peak, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float top = _mm512_reduce_max_ps(peak);
    const bool finite = !nan && std::isfinite(top);
    int e = 0;
    std::frexp(finite ? top : 0.f, &e);  // top < 2^e
    e = std::max(e, -100);  // 2^(23 - e) and 2^(e - 23) stay normal floats; tinier x round
    row_scale[m] = finite ? std::ldexp(1.f, e - 23) : NAN;
    const __m512 up = _mm512_set1_ps(finite ? std::ldexp(1.f, 23 - e) : 0.f);
    uint8_t* a = planes + m * 3 * K;
    for (int64_t k = 0; k < K; k += 16) {  // X = x 2^(23 - e), |X| < 2^23, nearest even
      const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(
          widen(_mm256_loadu_si256((const __m256i*)(xr + k))), up));
      _mm_storeu_si128((__m128i*)(a + k), _mm512_cvtepi32_epi8(X));  // low byte
      _mm_storeu_si128((__m128i*)(a + K + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(X, 8)));
      _mm_storeu_si128((__m128i*)(a + 2 * K + k), _mm512_cvtepi32_epi8(
          _mm512_add_epi32(_mm512_srai_epi32(X, 16), _mm512_set1_epi32(128))));
    }
  }
}

// packed [N/16, K/4, 64] int8 (16 outputs x 4 inputs); scales [N] float32; qsum [N] int32
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& qsum) {
  const int64_t NB = packed.size(0), K = packed.size(1) * 4, N = NB * 16;
  check_x(x, K);
  // K <= 65536: a plane's int32 sum of 255 x 128 products an input cannot wrap
  TORCH_CHECK(K % 16 == 0 && K <= 65536 && packed.is_contiguous() &&
              packed.scalar_type() == torch::kInt8 &&
              scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
              scales.numel() == N && qsum.scalar_type() == torch::kInt32 &&
              qsum.is_contiguous() && qsum.numel() == N,
              "int8_matmul takes cpu_ops.pack_int8's codes (inputs a multiple of 16, at most "
              "65536), float32 scales and int32 sums");
  const int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  uint16_t* op = (uint16_t*)out.data_ptr();
  if (M >= 4) {  // the codes as bf16, every row on vdpbf16ps
    const uint16_t* xp = (const uint16_t*)x.data_ptr();
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int8_t* w = wp + nb * K * 16;
          uint16_t* o = op + m0 * N + nb * 16;
          switch (std::min(kRows, M - m0)) {
#define TILE(R) case R: int8_bf16_tile<R>(xp + m0 * K, K, w, sp + nb * 16, o, N); break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
          }
        }
    });
    return out;
  }
  std::vector<uint8_t> planes(M * 3 * K);  // one to three rows: VNNI on the codes as stored
  std::vector<float> row_scale(M);
  int8_planes((const uint16_t*)x.data_ptr(), M, K, planes.data(), row_scale.data());
  const int32_t* qp = qsum.data_ptr<int32_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int8_t* w = wp + nb * K * 16;
      switch (M) {
#define TILE(R) \
  case R: int8_tile<R>(planes.data(), K, w, sp + nb * 16, qp + nb * 16, row_scale.data(), \
                       op + nb * 16, N); break;
        TILE(1) TILE(2) TILE(3)
#undef TILE
      }
    }
  });
  return out;
}

// packed [N/16, K/2, 32] bf16
torch::Tensor bf16_matmul(const torch::Tensor& x, const torch::Tensor& packed) {
  const int64_t NB = packed.size(0), K = packed.size(1) * 2, N = NB * 16;
  check_x(x, K);
  TORCH_CHECK(K % 4 == 0 && packed.is_contiguous(),
              "bf16_matmul takes cpu_ops.pack_bf16's weight");
  const int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)packed.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const uint16_t* xm = xp + m0 * K;
        uint16_t* o = op + m0 * N + nb * 16;
        switch (std::min(kRows, M - m0)) {
#define TILE(R) case R: bf16_tile<R>(xm, K, wp + nb * K * 16, o, N); break;
          TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
        }
      }
  });
  return out;
}

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

// Decode attention over a paged bf16 cache: one query row per sequence, read in place.
// q [S, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [S, W] int32;
// seq_lens [S] int64. Query head h reads KV head h / (H / Hkv). Scores, softmax and the
// weighted sum in float32, rounded once to bf16; window > 0 keeps the last `window` keys.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window) {
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

// RMSNorm of bf16 rows with the twin's roundings (reference/ops/layernorm.py): the residual
// sum rounded to bf16, the norm in float32, normed rounded to bf16, then times the weight,
// rounded again. One pass over a row where the twin runs ten operators.
AVX512BF16 static void rms_norm_rows(const uint16_t* x, const uint16_t* residual,
                                     const uint16_t* weight, float eps, int64_t T,
                                     int64_t hidden, uint16_t* normed, uint16_t* sum) {
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* xr = x + t * hidden;
    uint16_t* sr = residual ? sum + t * hidden : nullptr;  // x + residual
    __m512 squares = _mm512_setzero_ps();
    for (int64_t d = 0; d < hidden; d += 16) {
      __m256i bits = _mm256_loadu_si256((const __m256i*)(xr + d));
      if (residual) {
        bits = narrow(_mm512_add_ps(widen(bits), widen(_mm256_loadu_si256(
            (const __m256i*)(residual + t * hidden + d)))));
        _mm256_storeu_si256((__m256i*)(sr + d), bits);
      }
      const __m512 v = widen(bits);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / hidden + eps);
    const uint16_t* src = residual ? sr : xr;
    for (int64_t d = 0; d < hidden; d += 16) {
      const __m512 n = widen(narrow(_mm512_mul_ps(
          widen(_mm256_loadu_si256((const __m256i*)(src + d))), _mm512_set1_ps(r))));
      const __m512 w = widen(_mm256_loadu_si256((const __m256i*)(weight + d)));
      _mm256_storeu_si256((__m256i*)(normed + t * hidden + d), narrow(_mm512_mul_ps(n, w)));
    }
  }
}

// x, residual [T, hidden] bf16, weight [hidden] bf16 -> (normed, x + residual)
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight,
                                                      double eps) {
  const int64_t hidden = x.size(-1), T = x.numel() / hidden;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
              residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == torch::kBFloat16 &&
              weight.scalar_type() == torch::kBFloat16 && weight.numel() == hidden &&
              hidden % 16 == 0, "add_rms_norm takes contiguous bf16 rows of 16k values");
  auto normed = torch::empty_like(x), sum = torch::empty_like(x);
  rms_norm_rows((const uint16_t*)x.data_ptr(), (const uint16_t*)residual.data_ptr(),
                (const uint16_t*)weight.data_ptr(), (float)eps, T, hidden,
                (uint16_t*)normed.data_ptr(), (uint16_t*)sum.data_ptr());
  return {normed, sum};
}

// x [T, hidden] bf16 -> normed (the new residual is x itself)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t hidden = x.size(-1), T = x.numel() / hidden;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
              weight.scalar_type() == torch::kBFloat16 && weight.numel() == hidden &&
              hidden % 16 == 0, "rms_norm takes contiguous bf16 rows of 16k values");
  auto normed = torch::empty_like(x);
  rms_norm_rows((const uint16_t*)x.data_ptr(), nullptr, (const uint16_t*)weight.data_ptr(),
                (float)eps, T, hidden, (uint16_t*)normed.data_ptr(), nullptr);
  return normed;
}

// The step's new K and V rows at their slots, for an unquantized bf16 cache: k, v
// [T, kv_heads, D] (rows of any stride, each row's heads contiguous), caches
// [blocks, block_size, kv_heads, D], slot_mapping [T] int64 (-1: padding, not stored).
void store_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16 &&
              k_cache.scalar_type() == torch::kBFloat16 && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2) &&
              k_cache.size(2) * k_cache.size(3) == row && v.sizes() == k.sizes() &&
              v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == torch::kBFloat16 && slot_mapping.numel() == T,
              "store_kv takes bf16 rows of [kv_heads, head_dim] and contiguous bf16 caches");
  auto sm = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // every slot first: a refused step writes nothing
    TORCH_CHECK(sp[t] < slots, "slot ", sp[t], " is outside the cache's ", slots, " slots");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    std::memcpy((uint16_t*)k_cache.data_ptr() + slot * row,
                (const uint16_t*)k.data_ptr() + t * k.stride(0), row * 2);
    std::memcpy((uint16_t*)v_cache.data_ptr() + slot * row,
                (const uint16_t*)v.data_ptr() + t * v.stride(0), row * 2);
  }
}

// Rotary with the step's tables (optimized/attention.py rotary_tables): x [T, heads, D]
// -> x * cos + roll(x, D / 2) * sin, each product and the sum rounded to bf16 as torch's
// three bf16 operators round them. cos, sin [T, 1, D] bf16 contiguous.
AVX512BF16 static torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos,
                                       const torch::Tensor& sin) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.stride(2) == 1 &&
              x.stride(1) == D && D % 32 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16 &&
              cos.numel() == T * D && sin.numel() == T * D,
              "rotary takes bf16 rows of heads of 32k values and contiguous tables");
  auto out = torch::empty({T, H, D}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* cp = (const uint16_t*)cos.data_ptr();
  const uint16_t* sp = (const uint16_t*)sin.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* xr = xp + t * x.stride(0) + h * D;
      for (int64_t d = 0; d < D; d += 16) {
        const int64_t r = (d + half) % D;  // roll by half: element d reads d - half
        const __m512 a = widen(narrow(_mm512_mul_ps(
            widen(_mm256_loadu_si256((const __m256i*)(xr + d))),
            widen(_mm256_loadu_si256((const __m256i*)(cp + t * D + d))))));
        const __m512 b = widen(narrow(_mm512_mul_ps(
            widen(_mm256_loadu_si256((const __m256i*)(xr + r))),
            widen(_mm256_loadu_si256((const __m256i*)(sp + t * D + d))))));
        _mm256_storeu_si256((__m256i*)(op + (t * H + h) * D + d),
                            narrow(_mm512_add_ps(a, b)));
      }
    }
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& cos,
                                                const torch::Tensor& sin) {
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("int4_matmul", &int4_matmul);
  m.def("int8_matmul", &int8_matmul);
  m.def("bf16_matmul", &bf16_matmul);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rms_norm", &rms_norm);
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()", &store_kv);
  m.def("rotary", &rotary);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this CPU has AVX-512 BF16 and VNNI");
  bind_decode_step(m);
}

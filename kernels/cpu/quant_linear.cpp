// The matrix products of a decode step on the CPU: int8 rows, int4 groups and bf16 weights.
// Beside kernels/quant_linear.py (Triton); twins: reference/ops/weight_quant.py
// (quantized_linear) and F.linear. kernels/cpu_ops.py packs the weights and says why each.
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
#include "cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace pagedllm_cpu;

namespace {

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

// packed [N/16, K/4, 32] uint8; scales, zeros [N/16, G, 16] bf16
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          int64_t group_size) {
  TORCH_CHECK(isa() == Isa::avx512, "int4_matmul has no path for ", isa_name(isa()));
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
  TORCH_CHECK(isa() == Isa::avx512, "int8_matmul has no path for ", isa_name(isa()));
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
  TORCH_CHECK(isa() == Isa::avx512, "bf16_matmul has no path for ", isa_name(isa()));
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

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("int4_matmul", &int4_matmul);
  m.def("int8_matmul", &int8_matmul);
  m.def("bf16_matmul", &bf16_matmul);
}

// Few-row matrix products for a CPU with AVX-512 BF16: x [M, K] bf16 times a weight held either
// as int4 codes with a scale and zero point per group (W4A16) or as bf16 (W16A16), -> [M, N] bf16.
//
// A decode step multiplies a few rows by every weight, so it is as fast as the weights can be
// read. The codes are turned into bf16 inside the registers, never written back as a float
// weight, and multiplied with vdpbf16ps: per 32-bit lane, two bf16 products added to a float32
// accumulator. A 512-bit register then holds 16 outputs x 2 inputs, which is the layout the
// weights are packed in (cpu_matmul.py): for every block of 16 outputs, the inputs in pairs.
//
// int4 codes q in [0, 15] stand for (q - 8) s + z in their group. 0x4300 | q is the bf16 bit
// pattern of 128 + q (bf16 keeps 7 mantissa bits), so one OR turns a code into a bf16 number
// and a group's products sum to  D = sum x (128 + q).  With X = sum x over the group,
//     sum x w = s sum x q + (z - 8 s) X = s D + (z - 136 s) X,
// so the packer stores z - 136 s and the kernel adds X times it: two FMAs a group.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

namespace {

// MB rows x 16 outputs of the int4 product; xs holds each row's sum over each group.
template <int MB>
AVX512BF16 void int4_tile(const uint16_t* x, int64_t K, const uint8_t* w, const float* scale,
                          const float* zero, const float* xs, int64_t G, int64_t gs,
                          uint16_t* out, int64_t N) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
      // 32 bytes: low nibbles are inputs k, k+1 of the 16 outputs, high nibbles k+2, k+3
      __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + k * 8)));
      __m512bh lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(b, low4), bf16_128);
      __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), bf16_128);
      for (int m = 0; m < MB; ++m) {
        const int32_t* xr = (const int32_t*)(x + m * K + k);  // inputs k..k+3 as two pairs
        dot[m] = _mm512_dpbf16_ps(dot[m], lo, (__m512bh)_mm512_set1_epi32(xr[0]));
        dot[m] = _mm512_dpbf16_ps(dot[m], hi, (__m512bh)_mm512_set1_epi32(xr[1]));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * 16), z = _mm512_loadu_ps(zero + g * 16);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(dot[m], s, acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), z, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

// MB rows x 16 outputs of the bf16 product.
template <int MB>
AVX512BF16 void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* out,
                          int64_t N) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512bh wk = (__m512bh)_mm512_loadu_si512((const void*)(w + k * 16));
    for (int m = 0; m < MB; ++m) {
      const int32_t* xr = (const int32_t*)(x + m * K + k);
      acc[m] = _mm512_dpbf16_ps(acc[m], wk, (__m512bh)_mm512_set1_epi32(xr[0]));
    }
  }
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

constexpr int64_t kRows = 8;  // rows a tile keeps in registers: 2 x 8 accumulators of 16 floats

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous [M, K] bfloat16 tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs; the weight takes ", K);
}

}  // namespace

bool supported() { return __builtin_cpu_supports("avx512bf16"); }

// packed [N/16, K/4, 32] uint8; scales, zeros [N/16, G, 16] float32 (zeros hold z - 136 s)
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          int64_t group_size) {
  const int64_t NB = packed.size(0), K = packed.size(1) * 4, N = NB * 16, G = K / group_size;
  check_x(x, K);
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
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const uint16_t* xm = xp + m0 * K;
        const float* xsm = xs.data() + m0 * G;
        const uint8_t* w = wp + nb * K * 8;
        const float *s = sp + nb * G * 16, *z = zp + nb * G * 16;
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

// packed [N/16, K/2, 32] bf16
torch::Tensor bf16_matmul(const torch::Tensor& x, const torch::Tensor& packed) {
  const int64_t NB = packed.size(0), K = packed.size(1) * 2, N = NB * 16;
  check_x(x, K);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this CPU has AVX-512 BF16");
  m.def("int4_matmul", &int4_matmul, "x [M, K] bf16 times packed int4 groups -> [M, N] bf16");
  m.def("bf16_matmul", &bf16_matmul, "x [M, K] bf16 times a packed bf16 weight -> [M, N] bf16");
}

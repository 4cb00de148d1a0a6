// What every CPU kernel file shares: the instruction-set paths and the choice between them,
// bf16 conversions, and the kernels decode_step.cpp strings together.
//
// Each op has a path per instruction set: AVX-512 (with BF16 and VNNI, as on AMD Zen 4 and
// Intel Sapphire Rapids), AVX2 with FMA (x86-64-v3: every x86-64 CPU of the last ten years)
// and portable C++ that compiles anywhere (ARM included). Each is compiled for its own target
// (a function attribute), so one build runs on every CPU, and the op picks the best path the
// CPU has at run time: isa(), capped by set_isa() (tests run every path the machine has).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace pagedllm_cpu {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

Isa machine_isa();  // avx512: AVX-512 F/BW/VL, BF16 and VNNI; avx2: AVX2, FMA and F16C
Isa isa();          // the path the kernels take now: machine_isa(), or less if capped
void set_isa(Isa cap);
const char* isa_name(Isa isa);

// bf16 is the top half of a float32.
inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = (uint32_t)bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float32 -> bf16, nearest even (as torch and vcvtneps2bf16 round); a NaN stays a NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace pagedllm_cpu

#if defined(__x86_64__) || defined(_M_X64)
#define PAGEDLLM_X86 1
#include <immintrin.h>

#define AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma")))
#define AVX2FMA __attribute__((target("avx2,fma,f16c")))

AVX512BF16 static inline __m512 widen(__m256i bits) {  // 16 bf16 -> 16 float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
AVX512BF16 static inline __m256i narrow(__m512 v) {  // 16 float32 -> 16 bf16, nearest even
  return (__m256i)_mm512_cvtneps_pbh(v);
}
#endif

// The ops decode_step.cpp calls (each file says what its op computes and the layouts it takes).
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          int64_t group_size);
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& qsum);
torch::Tensor bf16_matmul(const torch::Tensor& x, const torch::Tensor& packed);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
void store_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const torch::Tensor& slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& cos,
                                                const torch::Tensor& sin);

void bind_decode_step(pybind11::module& m);  // decode_step.cpp's classes

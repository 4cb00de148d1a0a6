// What every CPU kernel file shares: the instruction-set paths and the choice between them,
// bf16 conversions, and the kernels decode_step.cpp strings together.
//
// Each op has a path per instruction set: AVX-512 (with BF16 and VNNI, as on AMD Zen 4 and
// Intel Sapphire Rapids), AVX2 with FMA (x86-64-v3: every x86-64 CPU of the last ten years)
// and portable C++ that compiles anywhere (ARM included). Each is compiled for its own target
// (a function attribute), so one build runs on every CPU, and the op picks the best path the
// CPU has at run time: isa(), capped by set_isa() (tests run every path the machine has).
//
// Each op file includes only ATen and torch's operator registry (TORCH_LIBRARY_FRAGMENT), not
// <torch/extension.h> (the C++ frontend, autograd and pybind11): about 12 s of compiling a
// file on 2 cores instead of 40. Only extension.cpp and decode_step.cpp talk to Python.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace pagedllm_cpu {

// Each level includes the ones below it: a kernel with an AVX-512 path takes it from
// `path >= Isa::avx512`. amx adds Intel's AMX tiles (Sapphire Rapids on), which only the bf16
// product of a few rows or more uses (quant_linear.cpp: bf16_amx).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };

// amx: avx512 plus AMX-TILE and AMX-BF16, where Linux also grants the tiles' state;
// avx512: AVX-512 F/BW/VL, BF16 and VNNI; avx2: AVX2, FMA and F16C
Isa machine_isa();
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

// torch::Tensor, torch::empty, torch::kBFloat16...: the ATen names, as <torch/types.h> makes
// them (without its autograd headers), for the files that spell them so.
namespace torch {
using namespace at;  // NOLINT
}

#if defined(__x86_64__) || defined(_M_X64)
#define PAGEDLLM_X86 1
#include <immintrin.h>

#define AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma")))
#define AVX2FMA __attribute__((target("avx2,fma,f16c")))
// AMX needs GCC 11 or clang 12 to compile and Linux's leave to run (extension.cpp): without
// either the amx path is left out and the bf16 product stays on AVX-512.
#if defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : (defined(__GNUC__) && __GNUC__ >= 11))
#define PAGEDLLM_AMX 1
#define AMXBF16                                                                          \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni," \
                        "fma")))
#endif

AVX512BF16 static inline __m512 widen(__m256i bits) {  // 16 bf16 -> 16 float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
AVX512BF16 static inline __m256i narrow(__m512 v) {  // 16 float32 -> 16 bf16, nearest even
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// Loads and stores of 8 (AVX2) or 16 (AVX-512) values in float32 registers from rows of bf16
// (bit patterns, uint16_t) or float32: the kernels are templates over the row type.
AVX2FMA static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2FMA static inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
AVX2FMA static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// 8 float32 rounded to bf16 (nearest even, as float_to_bf16; a NaN stays a NaN), still in
// float32 registers: the low 16 bits cleared
AVX2FMA static inline __m256 round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_blendv_epi8(up, quiet, nan),
                                              _mm256_set1_epi32((int)0xFFFF0000u)));
}
AVX2FMA static inline void store8(uint16_t* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8(v)), 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                 _mm256_extracti128_si256(r, 1)));
}
AVX512BF16 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512BF16 static inline __m512 load16(const uint16_t* p) {
  return widen(_mm256_loadu_si256((const __m256i*)p));
}
AVX512BF16 static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
AVX512BF16 static inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, narrow(v));
}
// v rounded to the row type's precision, kept in float32: what storing and loading it does
AVX2FMA static inline __m256 keep8(const float*, __m256 v) { return v; }
AVX2FMA static inline __m256 keep8(const uint16_t*, __m256 v) { return round8(v); }
AVX512BF16 static inline __m512 keep16(const float*, __m512 v) { return v; }
AVX512BF16 static inline __m512 keep16(const uint16_t*, __m512 v) { return widen(narrow(v)); }
#endif

namespace pagedllm_cpu {
// The scalar path's loads and stores, and the same rounding.
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }
inline float keep1(const float*, float v) { return v; }
inline float keep1(const uint16_t*, float v) { return bf16_to_float(float_to_bf16(v)); }

// Calls f with the rows' element type: a null pointer of uint16_t (bf16) or float. Kernels
// take bf16 and float32 rows; any other dtype is refused by the caller's check.
template <class F>
decltype(auto) with_rows(at::ScalarType dtype, F&& f) {
  if (dtype == at::kBFloat16) return f((uint16_t*)nullptr);
  return f((float*)nullptr);
}
}  // namespace pagedllm_cpu

// The ops decode_step.cpp calls (each file says what its op computes and the layouts it takes).
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& qsum);
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed);
at::Tensor fp8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin);

// Rotary position embedding of q and k with the step's cos/sin tables.
// Beside kernels/rotary.py (Triton); twin: reference/ops/rotary.py (rotary), as
// optimized/attention.py's rotate_half computes it from the tables.

#include "cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace pagedllm_cpu;

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
  TORCH_CHECK(isa() == Isa::avx512, "rotary has no path for ", isa_name(isa()));
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rotary", &rotary);
}

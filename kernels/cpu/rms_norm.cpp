// RMSNorm, with or without the residual add, in one pass a row.
// Beside kernels/rms_norm.py (Triton); twin: reference/ops/layernorm.py (rms_norm).

#include "cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace pagedllm_cpu;

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
  TORCH_CHECK(isa() == Isa::avx512, "add_rms_norm has no path for ", isa_name(isa()));
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
  TORCH_CHECK(isa() == Isa::avx512, "rms_norm has no path for ", isa_name(isa()));
  const int64_t hidden = x.size(-1), T = x.numel() / hidden;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
              weight.scalar_type() == torch::kBFloat16 && weight.numel() == hidden &&
              hidden % 16 == 0, "rms_norm takes contiguous bf16 rows of 16k values");
  auto normed = torch::empty_like(x);
  rms_norm_rows((const uint16_t*)x.data_ptr(), nullptr, (const uint16_t*)weight.data_ptr(),
                (float)eps, T, hidden, (uint16_t*)normed.data_ptr(), nullptr);
  return normed;
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rms_norm", &rms_norm);
}

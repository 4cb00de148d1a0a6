// RMSNorm, with or without the residual add, in one pass a row.
// Beside kernels/rms_norm.py (Triton); twin: reference/ops/layernorm.py (rms_norm).

#include "cpu.h"

#include <cmath>

using namespace pagedllm_cpu;

// RMSNorm of rows of bf16 or float32 (T: uint16_t or float) with the twin's roundings
// (reference/ops/layernorm.py): the residual sum in the rows' dtype, the norm in float32,
// normed = x * r rounded to the rows' dtype, then weight * normed, rounded again. In bf16 that
// is three roundings to bf16; in float32 none beyond float32's own. One pass over a row where
// the twin runs ten operators. Only the sum of squares adds in another order than torch's.
// Each path does the same per value: 16 (AVX-512), 8 (AVX2) or 1 (scalar) at a time.
namespace {

template <class T>
void rows_scalar(const T* x, const T* residual, const T* weight, float eps, int64_t rows,
                 int64_t hidden, T* normed, T* sum) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* src = x + t * hidden;
    float squares = 0.f;
    for (int64_t d = 0; d < hidden; ++d) {
      float v = load1(src + d);
      if (residual) {  // x + residual, stored in the rows' dtype
        store1(sum + t * hidden + d, v + load1(residual + t * hidden + d));
        v = load1(sum + t * hidden + d);
      }
      squares += v * v;
    }
    const float r = 1.f / std::sqrt(squares / hidden + eps);
    if (residual) src = sum + t * hidden;
    for (int64_t d = 0; d < hidden; ++d)
      store1(normed + t * hidden + d, keep1(src, load1(src + d) * r) * load1(weight + d));
  }
}

#ifdef PAGEDLLM_X86
// --8<-- [start:avx2]
template <class T>
AVX2FMA void rows_avx2(const T* x, const T* residual, const T* weight, float eps,
                       int64_t rows, int64_t hidden, T* normed, T* sum) {
  const int64_t whole = hidden / 8 * 8;  // the rest one value at a time
  for (int64_t t = 0; t < rows; ++t) {
    const T* src = x + t * hidden;
    T* s = sum + t * hidden;
    __m256 squares = _mm256_setzero_ps();
    float tail = 0.f;
    for (int64_t d = 0; d < whole; d += 8) {
      __m256 v = load8(src + d);
      if (residual) {
        v = keep8(src, _mm256_add_ps(v, load8(residual + t * hidden + d)));
        store8(s + d, v);
      }
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    for (int64_t d = whole; d < hidden; ++d) {
      float v = load1(src + d);
      if (residual) {
        store1(s + d, v + load1(residual + t * hidden + d));
        v = load1(s + d);
      }
      tail += v * v;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, squares);
    for (float lane : lanes) tail += lane;
    const float r = 1.f / std::sqrt(tail / hidden + eps);
    if (residual) src = s;
    for (int64_t d = 0; d < whole; d += 8) {
      const __m256 n = keep8(src, _mm256_mul_ps(load8(src + d), _mm256_set1_ps(r)));
      store8(normed + t * hidden + d, _mm256_mul_ps(n, load8(weight + d)));
    }
    for (int64_t d = whole; d < hidden; ++d) {
      const float n = keep1(src, load1(src + d) * r);
      store1(normed + t * hidden + d, n * load1(weight + d));
    }
  }
}
// --8<-- [end:avx2]

template <class T>
AVX512BF16 void rows_avx512(const T* x, const T* residual, const T* weight, float eps,
                            int64_t rows, int64_t hidden, T* normed, T* sum) {
  const int64_t whole = hidden / 16 * 16;  // the rest one value at a time
  for (int64_t t = 0; t < rows; ++t) {
    const T* src = x + t * hidden;
    T* s = sum + t * hidden;
    __m512 squares = _mm512_setzero_ps();
    float tail = 0.f;
    for (int64_t d = 0; d < whole; d += 16) {
      __m512 v = load16(src + d);
      if (residual) {
        v = keep16(src, _mm512_add_ps(v, load16(residual + t * hidden + d)));
        store16(s + d, v);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    for (int64_t d = whole; d < hidden; ++d) {
      float v = load1(src + d);
      if (residual) {
        store1(s + d, v + load1(residual + t * hidden + d));
        v = load1(s + d);
      }
      tail += v * v;
    }
    const float r = 1.f / std::sqrt((_mm512_reduce_add_ps(squares) + tail) / hidden + eps);
    if (residual) src = s;
    for (int64_t d = 0; d < whole; d += 16) {
      const __m512 n = keep16(src, _mm512_mul_ps(load16(src + d), _mm512_set1_ps(r)));
      store16(normed + t * hidden + d, _mm512_mul_ps(n, load16(weight + d)));
    }
    for (int64_t d = whole; d < hidden; ++d)
      store1(normed + t * hidden + d, keep1(src, load1(src + d) * r) * load1(weight + d));
  }
}
#endif

// The path isa() names, on rows of the tensors' dtype. residual undefined: plain RMSNorm.
void norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
          double eps, at::Tensor& normed, at::Tensor& sum) {
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  with_rows(x.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* r = residual.defined() ? (const T*)residual.data_ptr() : nullptr;
    T* s = residual.defined() ? (T*)sum.data_ptr() : nullptr;
    auto run = rows_scalar<T>;
#ifdef PAGEDLLM_X86
    if (isa() >= Isa::avx512) run = rows_avx512<T>;
    else if (isa() == Isa::avx2) run = rows_avx2<T>;
#endif
    run((const T*)x.data_ptr(), r, (const T*)weight.data_ptr(), (float)eps, rows, hidden,
        (T*)normed.data_ptr(), s);
  });
}

void check(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
              x.dim() >= 1 && x.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
              weight.is_contiguous() && weight.numel() == x.size(-1),
              op, " takes contiguous bf16 or float32 rows and a weight of the rows' size "
              "and dtype");
}

}  // namespace

// x, residual [T, hidden], weight [hidden], all bf16 or all float32 -> (normed, x + residual)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check("add_rms_norm", x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == x.scalar_type(),
              "add_rms_norm takes a contiguous residual of x's shape and dtype");
  auto normed = at::empty_like(x), sum = at::empty_like(x);
  norm(x, residual, weight, eps, normed, sum);
  return {normed, sum};
}

// x [T, hidden] -> normed (the new residual is x itself)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check("rms_norm", x, weight);
  auto normed = at::empty_like(x), none = at::Tensor();
  norm(x, at::Tensor(), weight, eps, normed, none);
  return normed;
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rms_norm", &rms_norm);
}

// Rotary position embedding of q and k with the step's cos/sin tables.
// Beside kernels/rotary.py (Triton); twin: reference/ops/rotary.py (rotary), as
// optimized/attention.py's rotate_half computes it from the tables.

#include "cpu.h"

// x * cos + roll(x) * sin is three operators in torch, each rounded: no product may be fused
// into the sum (an FMA rounds once where torch rounds twice). GCC contracts a * b + c,
// intrinsics included, where the target has FMA; this file asks it not to (clang contracts
// only within one expression, and each product here is its own statement).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

using namespace pagedllm_cpu;

// Rotary with the step's tables (optimized/attention.py rotary_tables): x [T, heads, D] ->
// x * cos + roll(x, D / 2) * sin, each product and the sum rounded to the rows' dtype as
// torch's three operators round them (bf16: three roundings to bf16; float32: float32's
// own). cos, sin [T, 1, D] contiguous, in x's dtype. Element d reads x[(d + D / 2) % D]: each
// half of a head is a run of contiguous reads, done 16 (AVX-512), 8 (AVX2) or 1 at a time.
namespace {

template <class T>
void run_scalar(const T* x, const T* c, const T* s, int64_t from, int64_t to, int64_t roll,
                T* out) {
  for (int64_t d = from; d < to; ++d) {
    const float a = keep1(x, load1(x + d) * load1(c + d));
    const float b = keep1(x, load1(x + d + roll) * load1(s + d));
    store1(out + d, a + b);
  }
}

#ifdef PAGEDLLM_X86
template <class T>
AVX2FMA void run_avx2(const T* x, const T* c, const T* s, int64_t from, int64_t to,
                      int64_t roll, T* out) {
  int64_t d = from;
  for (; d + 8 <= to; d += 8) {
    const __m256 a = keep8(x, _mm256_mul_ps(load8(x + d), load8(c + d)));
    const __m256 b = keep8(x, _mm256_mul_ps(load8(x + d + roll), load8(s + d)));
    store8(out + d, _mm256_add_ps(a, b));
  }
  run_scalar(x, c, s, d, to, roll, out);
}

template <class T>
AVX512BF16 void run_avx512(const T* x, const T* c, const T* s, int64_t from, int64_t to,
                           int64_t roll, T* out) {
  int64_t d = from;
  for (; d + 16 <= to; d += 16) {
    const __m512 a = keep16(x, _mm512_mul_ps(load16(x + d), load16(c + d)));
    const __m512 b = keep16(x, _mm512_mul_ps(load16(x + d + roll), load16(s + d)));
    store16(out + d, _mm512_add_ps(a, b));
  }
  run_scalar(x, c, s, d, to, roll, out);
}
#endif

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3, "rotary takes [tokens, heads, head_dim] rows");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
              x.stride(2) == 1 && x.stride(1) == D && D % 2 == 0 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type() && cos.numel() == T * D &&
              sin.numel() == T * D,
              "rotary takes bf16 or float32 rows of heads (each head contiguous, of an even "
              "size) and contiguous tables of their dtype");
  auto out = at::empty({T, H, D}, x.options());
  with_rows(x.scalar_type(), [&](auto* type) {
    using T_ = std::remove_pointer_t<decltype(type)>;
    auto run = run_scalar<T_>;
#ifdef PAGEDLLM_X86
    if (isa() >= Isa::avx512) run = run_avx512<T_>;
    else if (isa() == Isa::avx2) run = run_avx2<T_>;
#endif
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const T_* xr = (const T_*)x.data_ptr() + t * x.stride(0) + h * D;
        const T_* c = (const T_*)cos.data_ptr() + t * D;
        const T_* s = (const T_*)sin.data_ptr() + t * D;
        T_* o = (T_*)out.data_ptr() + (t * H + h) * D;
        run(xr, c, s, 0, half, half, o);   // the first half reads the second
        run(xr, c, s, half, D, -half, o);  // the second half reads the first
      }
  });
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rotary", &rotary);
}

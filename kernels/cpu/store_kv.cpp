// The step's new K and V rows written at their slots of the paged cache.
// Beside kernels/store_kv.py (Triton); twin: reference/ops/cache_ops.py (store_kv).

#include "cpu.h"

#include <cstring>

using namespace pagedllm_cpu;

// The step's new K and V rows at their slots, for an unquantized cache of bf16 or float32 (a
// row copy: the same on every path): k, v [T, kv_heads, D] of the caches' dtype (rows of any
// stride, each row's heads contiguous), caches [blocks, block_size, kv_heads, D],
// slot_mapping [T] int64 (-1: padding, not stored).
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k_cache.dim() == 4, "store_kv takes [T, kv_heads, head_dim] "
              "rows and [blocks, block_size, kv_heads, head_dim] caches");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype &&
              v.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(2) == 1 &&
              v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2) &&
              k_cache.size(2) * k_cache.size(3) == row && v.sizes() == k.sizes() &&
              v_cache.sizes() == k_cache.sizes() && slot_mapping.numel() == T,
              "store_kv takes bf16 or float32 rows of [kv_heads, head_dim] and contiguous "
              "caches of their dtype");
  auto sm = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // every slot first: a refused step writes nothing
    TORCH_CHECK(sp[t] < slots, "slot ", sp[t], " is outside the cache's ", slots, " slots");
  const int64_t size = k.element_size();  // 2 or 4 bytes a value
  char* kc = (char*)k_cache.data_ptr();
  char* vc = (char*)v_cache.data_ptr();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * row * size, (const char*)k.data_ptr() + t * k.stride(0) * size,
                row * size);
    std::memcpy(vc + slot * row * size, (const char*)v.data_ptr() + t * v.stride(0) * size,
                row * size);
  }
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()", &store_kv);
}

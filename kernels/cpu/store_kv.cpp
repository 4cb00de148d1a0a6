// The step's new K and V rows written at their slots of the paged cache.
// Beside kernels/store_kv.py (Triton); twin: reference/ops/cache_ops.py (store_kv).

#include "cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace pagedllm_cpu;

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

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()", &store_kv);
}

// The kernels of cpu_ops.cpp that decode_step.cpp strings together (cpu_ops.cpp says what
// each computes and the layouts it takes).
#pragma once
#include <torch/extension.h>

#include <tuple>

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

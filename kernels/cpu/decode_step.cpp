// A decode step's decoder layers in one call from Python: the CPU's counterpart of the
// CUDA graph the runner replays on a GPU (decode_step.py says when it is used).
//
// A step of one sequence on SmolLM2 is 30 layers of about ten operators, each microseconds
// of arithmetic after microseconds of Python: the module calls, the views, the dispatch.
// Here the same operators, in the same order, on the same kernels (the op files, and ATen's
// silu and products for the activation), are called from C++ with the GIL released: the
// Python is paid once a step instead of once an operator, and the server's event loop runs
// while the layers do. Each kernel call is recorded under its operator's name, so a
// profile of a step reads as the modules' profile does. It runs bf16 and float32 models, on
// every instruction-set path the kernels have.
#include "cpu.h"

#include <ATen/record_function.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

// a kernel call under its operator's name, for the profiler
#define RECORD(op) RECORD_FUNCTION("pagedllm_cpu::" op, std::vector<c10::IValue>())

namespace {

// One linear layer's weight: in one of the kernels' layouts (quant_layers.py packs them), or
// a float32 model's dense weight as layers.py's TransposedLinear holds it, [in, out].
struct Product {
  std::string kind;  // "bf16", "int8", "int4", "fp8" (our kernels) or "dense" (ATen's product)
  at::Tensor packed, scales, aux;  // aux: int8's code sums, int4's zero points
  c10::optional<at::Tensor> bias;
  int64_t group_size;

  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == "dense")  // TransposedLinear's own operators (the profiler names them)
      return bias ? at::addmm(*bias, x, packed) : at::mm(x, packed);
    RECORD_FUNCTION(kind == "int8"   ? "pagedllm_cpu::int8_matmul"
                    : kind == "int4" ? "pagedllm_cpu::int4_matmul"
                    : kind == "fp8"  ? "pagedllm_cpu::fp8_matmul"
                                     : "pagedllm_cpu::bf16_matmul",
                    std::vector<c10::IValue>());  // a name chosen at run time
    at::Tensor y = kind == "int8"   ? int8_matmul(x, packed, scales, aux)
                   : kind == "int4" ? int4_matmul(x, packed, scales, aux, group_size)
                   : kind == "fp8"  ? fp8_matmul(x, packed, scales)
                                    : bf16_matmul(x, packed);
    return bias ? y + *bias : y;  // as the module adds it: one add in the model's dtype
  }
};

struct Layer {  // reference/model/llama.py's LlamaDecoderLayer, merged (layers.py)
  at::Tensor input_norm, post_norm;
  double eps;
  Product qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim, window;  // window 0: every key
  double scale;
};

class DecodeStack {
 public:
  void add_layer(const Layer& layer) { layers_.push_back(layer); }

  // x [S, hidden] bf16 or float32 (one row a sequence) -> (the last layer's output, the residual
  // stream before it), as LlamaForCausalLM's loop over its layers returns them.
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
      std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
      const at::Tensor& block_tables, const at::Tensor& seq_lens,
      const at::Tensor& slot_mapping) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "a K and a V cache per layer: ", layers_.size(), " layers, got ",
                k_caches.size(), " and ", v_caches.size());
    const int64_t S = x.size(0);
    at::Tensor residual;
    // --8<-- [start:layer]
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      at::Tensor h;
      if (residual.defined()) {
        RECORD("add_rms_norm");
        std::tie(h, residual) = add_rms_norm(x, residual, L.input_norm, L.eps);
      } else {
        RECORD("rms_norm");
        h = rms_norm(x, L.input_norm, L.eps);
        residual = x;
      }
      // attention: Q, K, V as views of one product; K stored already rotated
      auto qkv = L.qkv(h).split({L.heads * L.head_dim, L.kv_heads * L.head_dim,
                                 L.kv_heads * L.head_dim}, -1);
      at::Tensor q, k, a;
      {
        RECORD("rotary");
        std::tie(q, k) = rotary(qkv[0].view({S, L.heads, L.head_dim}),
                                qkv[1].view({S, L.kv_heads, L.head_dim}), cos, sin);
      }
      {
        RECORD("store_kv");
        store_kv(k, qkv[2].view({S, L.kv_heads, L.head_dim}), k_caches[i], v_caches[i],
                 slot_mapping);
      }
      {
        RECORD("paged_decode_attention");
        a = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, seq_lens,
                                   L.scale, L.window);  // [S, heads, head_dim]
      }
      auto o = L.o(a.view({S, -1}));
      {
        RECORD("add_rms_norm");
        std::tie(h, residual) = add_rms_norm(o, residual, L.post_norm, L.eps);
      }
      // the MLP: silu(gate) * up as reference/ops/activation.py computes it
      auto gate_up = L.gate_up(h).chunk(2, -1);
      x = L.down(at::silu(gate_up[0]) * gate_up[1]);
    }
    // --8<-- [end:layer]
    return {x, residual};
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decode_step(pybind11::module& m);  // extension.cpp's module calls it

void bind_decode_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Product>(m, "Product")
      .def(py::init<std::string, at::Tensor, at::Tensor, at::Tensor,
                    c10::optional<at::Tensor>, int64_t>(),
           py::arg("kind"), py::arg("packed"), py::arg("scales"), py::arg("aux"),
           py::arg("bias"), py::arg("group_size"));
  py::class_<Layer>(m, "Layer")
      .def(py::init<at::Tensor, at::Tensor, double, Product, Product, Product, Product,
                    int64_t, int64_t, int64_t, int64_t, double>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("window"), py::arg("scale"));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}

// The extension module: which instruction-set path the kernels take (cpu.h), and the decode
// step's classes. The ops themselves register as torch operators in their own files
// (TORCH_LIBRARY_FRAGMENT), named torch.ops.pagedllm_cpu.*.
#include "cpu.h"

#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <string>

namespace pagedllm_cpu {

namespace {
std::atomic<int> cap{(int)Isa::avx512};
}

Isa machine_isa() {
#ifdef PAGEDLLM_X86
  static const Isa found = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
        __builtin_cpu_supports("avx512vnni"))
      return Isa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return Isa::avx2;
    return Isa::scalar;
  }();
  return found;
#else
  return Isa::scalar;
#endif
}

Isa isa() { return (Isa)std::min((int)machine_isa(), cap.load(std::memory_order_relaxed)); }

void set_isa(Isa level) { cap.store((int)level, std::memory_order_relaxed); }

const char* isa_name(Isa level) {
  switch (level) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace pagedllm_cpu

namespace {

pagedllm_cpu::Isa parse_isa(const std::string& name) {
  for (auto level : {pagedllm_cpu::Isa::scalar, pagedllm_cpu::Isa::avx2,
                     pagedllm_cpu::Isa::avx512})
    if (name == pagedllm_cpu::isa_name(level)) return level;
  TORCH_CHECK(false, "isa must be 'avx512', 'avx2' or 'scalar', got '", name, "'");
}

}  // namespace

void bind_decode_step(pybind11::module& m);  // decode_step.cpp's classes

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("machine_isa", [] { return std::string(pagedllm_cpu::isa_name(
      pagedllm_cpu::machine_isa())); }, "the best instruction-set path this CPU runs");
  m.def("isa", [] { return std::string(pagedllm_cpu::isa_name(pagedllm_cpu::isa())); },
        "the path the kernels take now");
  m.def("set_isa", [](const std::string& name) { pagedllm_cpu::set_isa(parse_isa(name)); },
        "cap the kernels' path (a test runs each path the machine has)");
  bind_decode_step(m);
}

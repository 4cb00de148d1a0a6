// The extension module: which instruction-set path the kernels take (cpu.h), and the decode
// step's classes. The ops themselves register as torch operators in their own files
// (TORCH_LIBRARY_FRAGMENT), named torch.ops.pagedllm_cpu.*.
#include "cpu.h"

#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <string>

#ifdef PAGEDLLM_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedllm_cpu {

namespace {
std::atomic<int> cap{(int)Isa::amx};

#ifdef PAGEDLLM_AMX
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and Linux's leave to use them:
// a process must ask for the tiles' 8 KiB of state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA) before its first tile instruction, or that instruction faults.
// oneDNN asks the same way; asking twice is harmless.
bool amx_granted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}
#endif
}  // namespace

Isa machine_isa() {
#ifdef PAGEDLLM_X86
  static const Isa found = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
        __builtin_cpu_supports("avx512vnni")) {
#ifdef PAGEDLLM_AMX
      if (amx_granted()) return Isa::amx;
#endif
      return Isa::avx512;
    }
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
    case Isa::amx: return "amx";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace pagedllm_cpu

namespace {

pagedllm_cpu::Isa parse_isa(const std::string& name) {
  for (auto level : {pagedllm_cpu::Isa::scalar, pagedllm_cpu::Isa::avx2,
                     pagedllm_cpu::Isa::avx512, pagedllm_cpu::Isa::amx})
    if (name == pagedllm_cpu::isa_name(level)) return level;
  TORCH_CHECK(false, "isa must be 'amx', 'avx512', 'avx2' or 'scalar', got '", name, "'");
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

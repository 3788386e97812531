// Run-time choice of the kernel ISA from the CPU's features (the wheel carries all of them).
#include <stdexcept>
#include <string>
#include <vector>

#include "paged_attention.h"

namespace pm {
namespace {

bool cpu_has(const std::string& isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (isa == "avx2" || isa == "avx2_w16")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "generic";
}

const IsaKernels* kernels_named(const std::string& isa) {
  if (isa == "avx512") return &isa_avx512::kernels;
  if (isa == "avx2") return &isa_avx2::kernels;
  if (isa == "avx2_w16") return &isa_avx2_w16::kernels;
  if (isa == "generic") return &isa_generic::kernels;
  return nullptr;
}

bool fits(const IsaKernels& k, int64_t head_dim, int64_t block_size) {
  return head_dim % k.lanes == 0 && block_size % k.lanes == 0;
}

}  // namespace

// NOTE: why by core, not by size. On Zen 4 the kernel read faster with every prefetch going to
// L2 (T1), on every shape and dtype measured, head sizes 64 and 128, including steps whose K and
// V fit L1 several times over; on Zen 5 bfloat16 read slower that way and on Emerald Rapids
// neither gained beyond noise (bench/attention_ab.py; docs/benchmarks/kernels.md, "Kernel design
// experiments"). So it is a property of the core's miss handling, not of the step's size. On
// Zen 3 (also family 19h, the AVX2 path) L1 and L2 read alike in paired runs: L2 as Zen 4.
PrefetchTo attention_prefetch_target() {
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_is("amdfam19h")) return PrefetchTo::kL2;  // Zen 3 and Zen 4
#endif
  return PrefetchTo::kL1;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const char* isa : {"avx512", "avx2", "avx2_w16", "generic"})
    if (cpu_has(isa)) names.emplace_back(isa);
  return names;
}

const IsaKernels& best_isa() {
  static const IsaKernels& best = *kernels_named(supported_isas().front());
  return best;
}

const IsaKernels& select_isa(const std::string& isa, int64_t head_dim, int64_t block_size) {
  if (isa == "auto") {
    for (const char* name : {"avx512", "avx2", "generic"})
      if (cpu_has(name) && fits(*kernels_named(name), head_dim, block_size))
        return *kernels_named(name);
    throw std::invalid_argument("head_dim and block_size must be multiples of 4");
  }
  const IsaKernels* k = kernels_named(isa);
  if (k == nullptr) throw std::invalid_argument("unknown isa '" + isa + "'");
  if (!cpu_has(isa)) throw std::invalid_argument("this CPU cannot run isa '" + isa + "'");
  if (!fits(*k, head_dim, block_size))
    throw std::invalid_argument("isa '" + isa + "' needs head_dim and block_size multiples of " +
                                std::to_string(k->lanes));
  return *k;
}

}  // namespace pm

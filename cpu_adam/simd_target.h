// Which SIMD instruction set the CPU kernels run with. Highway compiles each
// kernel once per target in HWY_TARGETS and picks the best one the CPU
// supports at run time; no -march=native anywhere.
#pragma once

#include <string>
#include <vector>

namespace tidal::cpu_adam {

// Name of the target HWY_DYNAMIC_DISPATCH chooses on this CPU ("AVX3", "AVX2",
// "SSE4", "NEON", "EMU128", ...), as reported by the dispatched code itself.
std::string chosen_simd_target();

// Every target compiled into this build that this CPU can run, best first.
std::vector<std::string> runnable_simd_targets();

}  // namespace tidal::cpu_adam

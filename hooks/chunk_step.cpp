#include "hooks/chunk_step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <exception>
#include <limits>

#include "cpu_adam/adam.h"
#include "runtime/core/error.h"

namespace tidal::hooks {
namespace {

namespace ca = tidal::cpu_adam;

ca::DType adam_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ca::DType::kFloat32;
    case DType::kFloat16:
      return ca::DType::kFloat16;
    case DType::kBFloat16:
      return ca::DType::kBFloat16;
  }
  TIDAL_INTERNAL_ASSERT(false, "unknown chunk dtype");
  return ca::DType::kFloat32;
}

std::size_t held(const ChunkScheduler& s, MemorySpace space) { return s.stats().held_bytes[index_of(space)]; }

// The chunks of `kinds` pinned in one space by accessing the chunk's first
// tensor (COMPUTE: the payloads cannot move), released on every path out.
class Pinned {
 public:
  Pinned(ChunkScheduler& s, TensorId first, MemorySpace space) : s_(s), first_(first), space_(space) {}
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    for (ChunkKind kind : held_) {
      try {
        s_.release(TensorRef{kind, first_}, TensorState::kHold);
      } catch (...) {
        // A release after an error must not hide the error; the scheduler
        // stays consistent (release only lowers a use count).
      }
    }
  }
  void pin(ChunkKind kind) {
    s_.access(TensorRef{kind, first_}, space_);
    held_.push_back(kind);
  }

 private:
  ChunkScheduler& s_;
  TensorId first_;
  MemorySpace space_;
  std::vector<ChunkKind> held_;
};

std::vector<ca::ChunkRange> ranges_of(const ChunkScheduler& s, std::uint32_t chunk, const ChunkStepGroup& g) {
  TIDAL_CHECK(g.tensors.size() == g.steps.size(), "step_chunk: ", g.tensors.size(), " tensors but ",
              g.steps.size(), " steps in a group");
  std::vector<ca::ChunkRange> out;
  out.reserve(g.tensors.size());
  for (std::size_t i = 0; i < g.tensors.size(); ++i) {
    const TensorPlacement& p = s.store().placement(g.tensors[i]);
    TIDAL_CHECK(p.chunk == chunk, "step_chunk: tensor ", g.tensors[i], " is in chunk ", p.chunk, ", not ",
                chunk);
    out.push_back({p.offset, p.numel, g.steps[i]});
  }
  return out;
}

// cpu_adam's SIMD step over the group's ranges (the host, the simulated device).
void simd_step(const std::array<const Chunk*, 4>& c, const Chunk* sums, const ChunkStepGroup& g,
               const std::vector<ca::ChunkRange>& ranges, const ChunkStepOptions& o) {
  const Chunk& w = *c[0];
  ca::AdamChunk chunk{static_cast<float*>(w.payload()), c[1]->payload(), c[2]->payload(), c[3]->payload(),
                      w.capacity_bytes() / sizeof(float), adam_dtype(c[3]->dtype()), adam_dtype(c[1]->dtype())};
  if (sums != nullptr) chunk.grad = static_cast<const float*>(sums->payload());
  ca::AdamStepOptions opt;
  opt.loss_scale = 1.0 / o.grad_scale;
  opt.max_grad_norm = 0.0;
  opt.check_overflow = false;
  ca::adam_chunk_step(g.hyper, chunk, ranges, opt, ca::ExecOptions{o.num_threads, ca::CopyStores::kAuto, o.runner});
}

}  // namespace

std::vector<ca::ChunkRange> split_ranges(const std::vector<ca::ChunkRange>& ranges, std::size_t part) {
  TIDAL_CHECK(part > 0, "split_ranges: a part of 0 elements");
  std::vector<ca::ChunkRange> out;
  out.reserve(ranges.size());
  for (const ca::ChunkRange& r : ranges) {
    for (std::size_t done = 0; done < r.count; done += part) {
      out.push_back({r.offset + done, std::min(part, r.count - done), r.step});
    }
  }
  return out;
}

std::size_t fused_part(const ChunkStore& store, std::size_t max_temporary_bytes) {
  const ChunkStoreOptions& o = store.options();
  std::size_t part = o.chunk_bytes / element_size(o.param_dtype) / 4;
  // The temporaries of a call: the fp32 copy of 16-bit gradients (or of the
  // sums, scaled), and the fp32 copies of bf16 moments.
  constexpr std::size_t kTemporaries = 3;
  if (max_temporary_bytes > 0) part = std::min(part, max_temporary_bytes / (kTemporaries * sizeof(float)));
  return std::max<std::size_t>(1, part);
}

namespace {

// torch's fused Adam/AdamW over the group's tensors on a GPU, in parts of at
// most `part` elements (the fp32 copies of 16-bit gradients and of bf16
// moments are temporary device memory), then the 16-bit write-back. A tensor
// longer than a part is updated a part at a time (the update is elementwise,
// so the bits are those of one call): a tensor with a dedicated chunk larger
// than the chunk size (gpt-18b's 5120 x 20480 weights) asked for a 400 MiB
// fp32 copy of its gradient at once, which no cached chunk block could serve,
// and ran an H200 out of memory with 3.9 GiB cached
// (benchmarks/results/engine_largest-nvidia-h200.json). With `part` a
// quarter of a standard chunk's elements every temporary fits a freed chunk
// block; with a small device margin, fewer (ChunkStepOptions::max_temporary_bytes).
// torch's fused kernels take fp32 moments only, and always correct the bias
// by 1 - beta^step: without bias correction each tensor's step is +inf, so
// both corrections are exactly 1 (beta is in [0, 1), so beta^inf == 0; the
// config refuses other betas), the step size is lr and the denominator
// sqrt(v) + eps, as in cpu_adam's kernel.
void fused_step(const std::array<const Chunk*, 4>& c, const Chunk* sums, const ChunkStepGroup& g,
                const std::vector<ca::ChunkRange>& whole, std::size_t part, const ChunkStepOptions& o,
                const at::Device& device) {
  const ca::AdamHyperParams& hp = g.hyper;
  TIDAL_CHECK(hp.bias_correction || (hp.beta1 >= 0 && hp.beta1 < 1 && hp.beta2 >= 0 && hp.beta2 < 1),
              "step_chunk: without bias correction the betas must be in [0, 1), got (", hp.beta1, ", ",
              hp.beta2, ")");
  auto view = [&](const Chunk* ch) {
    const auto numel = static_cast<std::int64_t>(ch->capacity_bytes() / element_size(ch->dtype()));
    return slot_view(ch->payload(), {numel}, scalar_type_of(ch->dtype()), device);
  };
  const at::Tensor w = view(c[0]), m = view(c[1]), v = view(c[2]), h = view(c[3]);
  const at::Tensor s = sums != nullptr ? view(sums) : at::Tensor();
  const std::vector<ca::ChunkRange> ranges = split_ranges(whole, part);
  std::size_t start = 0;
  while (start < ranges.size()) {
    std::size_t end = start, size = 0;
    while (end < ranges.size() && size + ranges[end].count <= part) {
      size += ranges[end].count;
      ++end;
    }
    std::vector<at::Tensor> ws, hs, grads, ms, vs, m32, v32, steps;
    for (std::size_t i = start; i < end; ++i) {
      const auto off = static_cast<std::int64_t>(ranges[i].offset);
      const auto n = static_cast<std::int64_t>(ranges[i].count);
      ws.push_back(w.narrow(0, off, n));
      hs.push_back(h.narrow(0, off, n));
      ms.push_back(m.narrow(0, off, n));
      vs.push_back(v.narrow(0, off, n));
      if (s.defined()) {
        grads.push_back(s.narrow(0, off, n));
      } else {
        grads.push_back(h.scalar_type() == at::kFloat ? hs.back() : hs.back().to(at::kFloat));
      }
      m32.push_back(m.scalar_type() == at::kFloat ? ms.back() : ms.back().to(at::kFloat));
      v32.push_back(v.scalar_type() == at::kFloat ? vs.back() : vs.back().to(at::kFloat));
      const double step =
          hp.bias_correction ? static_cast<double>(ranges[i].step) : std::numeric_limits<double>::infinity();
      steps.push_back(at::full({}, step, w.options()));
    }
    if (o.grad_scale != 1.0) {
      // In place on temporaries or on 16-bit slots the write-back overwrites;
      // the gradient sums are left as they are (as the SIMD path leaves them).
      if (s.defined()) {
        grads = at::_foreach_mul(grads, o.grad_scale);
      } else {
        at::_foreach_mul_(grads, o.grad_scale);
      }
    }
    if (hp.adamw_mode) {
      at::_fused_adamw_(ws, grads, m32, v32, {}, steps, hp.lr, hp.beta1, hp.beta2, hp.weight_decay, hp.eps, false,
                        false);
    } else {
      at::_fused_adam_(ws, grads, m32, v32, {}, steps, hp.lr, hp.beta1, hp.beta2, hp.weight_decay, hp.eps, false,
                       false);
    }
    if (m.scalar_type() != at::kFloat) {
      at::_foreach_copy_(ms, m32);  // rounded to nearest even
      at::_foreach_copy_(vs, v32);
    }
    at::_foreach_copy_(hs, ws);
    start = end;
  }
}

}  // namespace

bool update_on_device(const ChunkScheduler& s, std::uint32_t chunk, const std::vector<ChunkKind>& kinds,
                      bool host_short, bool prefer_device) {
  const ChunkStore& store = s.store();
  // A master the host budget spilled to the device (Note [One place per
  // chunk]) is updated there: moving it down would only spill another up.
  if (host_short && store.chunk(make_chunk_id(ChunkKind::kParam32, chunk)).space() == MemorySpace::kDevice) {
    return true;
  }
  const Chunk& half = store.chunk(make_chunk_id(ChunkKind::kParam16, chunk));
  if (half.space() != MemorySpace::kDevice) return false;
  const std::size_t device_held = held(s, MemorySpace::kDevice);
  const std::size_t free = s.budget(MemorySpace::kDevice) > device_held ? s.budget(MemorySpace::kDevice) - device_held : 0;
  // The device bytes the update adds: the chunks of `kinds` not there yet
  // (states a plan keeps on the device are already counted in device_held).
  // Their own capacity: a tensor larger than the chunk size has a dedicated,
  // larger chunk.
  std::size_t need = 0;
  for (ChunkKind kind : kinds) {
    const Chunk& c = store.chunk(make_chunk_id(kind, chunk));
    if (c.space() != MemorySpace::kDevice) need += c.capacity_bytes();
  }
  const std::size_t host_held = held(s, MemorySpace::kHost);
  const std::size_t host_free = s.budget(MemorySpace::kHost) > host_held ? s.budget(MemorySpace::kHost) - host_held : 0;
  const bool host_full = host_free < half.capacity_bytes();
  return (prefer_device || host_full) && free >= need;
}

MemorySpace step_chunk(ChunkScheduler& s, const ParamBinding& binding, std::uint32_t chunk,
                       const std::vector<ChunkStepGroup>& groups, const ChunkStepOptions& o) {
  TensorId first = 0;
  bool any = false;
  for (const ChunkStepGroup& g : groups) {
    if (!g.tensors.empty()) {
      first = g.tensors.front();
      any = true;
      break;
    }
  }
  TIDAL_CHECK(any, "step_chunk: chunk ", chunk, " has no tensor to update");
  std::vector<ChunkKind> kinds{ChunkKind::kParam32, ChunkKind::kMomentum, ChunkKind::kVariance};
  if (o.use_sums) kinds.push_back(ChunkKind::kGradAccum);
  const MemorySpace space =
      update_on_device(s, chunk, kinds, o.host_short, o.prefer_device) ? MemorySpace::kDevice : MemorySpace::kHost;
  {
    Pinned pinned(s, first, space);
    pinned.pin(ChunkKind::kParam16);
    for (ChunkKind kind : kinds) pinned.pin(kind);
    const ChunkStore& store = s.store();
    auto chunk_of = [&](ChunkKind kind) { return &store.chunk(make_chunk_id(kind, chunk)); };
    const std::array<const Chunk*, 4> c{chunk_of(ChunkKind::kParam32), chunk_of(ChunkKind::kMomentum),
                                        chunk_of(ChunkKind::kVariance), chunk_of(ChunkKind::kParam16)};
    const Chunk* sums = o.use_sums ? chunk_of(ChunkKind::kGradAccum) : nullptr;
    for (const ChunkStepGroup& g : groups) {
      if (g.tensors.empty()) continue;
      const std::vector<ca::ChunkRange> ranges = ranges_of(s, chunk, g);
      if (space == MemorySpace::kHost || o.device_simd) {
        simd_step(c, sums, g, ranges, o);
      } else {
        fused_step(c, sums, g, ranges, fused_part(store, o.max_temporary_bytes), o,
                   binding.torch_device(space));
      }
    }
  }
  return space;
}

}  // namespace tidal::hooks

// GradientSums' fold with the weights' image (hooks/gradient_sums.h, Note
// [The weights' image instead of the restore]) on a chunk scheduler over the
// simulated device, driven as ModuleHooks drives it: the chunk goes up with
// its weights, its gradients land on the device, the fold runs on the host.
// After every fold the 16-bit slots must hold the fp32 masters rounded to
// bf16 (torch's rounding, the reference) and the sums the gradients; each
// case then says whether the fold took the image back, restored in its pass
// or restored at its end. Each guard of the image path has a case that fails
// without it.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hooks/gradient_sums.h"
#include "hooks/param_binding.h"
#include "runtime/device/sim_device.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {
namespace {

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr std::size_t kChunk = 4096;  // 2048 bf16 elements in the 16-bit list

TensorRef p16(TensorId t) { return {ChunkKind::kParam16, t}; }
TensorRef p32(TensorId t) { return {ChunkKind::kParam32, t}; }
TensorRef sum(TensorId t) { return {ChunkKind::kGradAccum, t}; }

// A store of bf16 tensors of `numels`, a scheduler over a simulated device,
// and the GradientSums under test, accumulating.
struct Rig {
  explicit Rig(const std::vector<std::size_t>& numels, std::size_t host_budget = SIZE_MAX)
      : scheduler(make_store(numels), make_sim_device({.capacity_bytes = 1 << 20}), options(host_budget)),
        binding(scheduler, at::Device(at::kCPU)),
        sums(&scheduler, &binding) {
    sums.set_accumulating(true);
    for (TensorId t = 0; t < numels.size(); ++t) {
      set_master(t, 0.37f * static_cast<float>(t + 1));
      weights_from_master(t);
    }
  }

  static ChunkStore make_store(const std::vector<std::size_t>& numels) {
    ChunkStore store({.chunk_bytes = kChunk, .param_dtype = DType::kBFloat16});
    for (std::size_t i = 0; i < numels.size(); ++i) store.register_tensor("w" + std::to_string(i), numels[i]);
    return store;
  }

  static ChunkSchedulerOptions options(std::size_t host_budget) {
    ChunkSchedulerOptions o;
    o.device_budget_bytes = 1 << 19;
    o.host_budget_bytes = host_budget;
    o.prefetch = false;
    return o;
  }

  std::int64_t numel(TensorId t) const { return static_cast<std::int64_t>(scheduler.store().tensor_numel(t)); }

  at::Tensor view(TensorRef ref, MemorySpace space, AccessMode mode = AccessMode::kWrite) {
    return binding.access(ref.tensor, ref.kind, space, {numel(ref.tensor)}, mode);
  }

  // The master of `t`: values that bf16 rounds (scale times a ramp with
  // fractions bf16 cannot hold).
  void set_master(TensorId t, float scale) {
    c10::NoGradGuard no_grad;
    view(p32(t), kHost).copy_(at::arange(numel(t), at::kFloat).mul_(scale / 7.0f).sin_().mul_(3.3f));
    scheduler.release(p32(t), TensorState::kHold);
  }

  // Reference: the master rounded by torch.
  at::Tensor master_rounded(TensorId t) {
    at::Tensor m = view(p32(t), kHost, AccessMode::kRead).clone();
    scheduler.release(p32(t), TensorState::kHold);
    return m.to(at::kBFloat16);
  }

  void weights_from_master(TensorId t) {
    c10::NoGradGuard no_grad;
    at::Tensor w = master_rounded(t);
    view(p16(t), kHost).copy_(w);
    scheduler.release(p16(t), TensorState::kHold);
  }

  // The weights go up for a forward (read there): the host block they came
  // from stays cached as the chunk's image.
  void up(const std::vector<TensorId>& ts) {
    for (const TensorId t : ts) {
      (void)view(p16(t), kDev, AccessMode::kRead);
      scheduler.release(p16(t), TensorState::kHold);
    }
  }

  at::Tensor gradient(TensorId t) const {
    return at::arange(numel(t), at::kFloat).mul_(0.01f * static_cast<float>(t + 2)).cos_().to(at::kBFloat16);
  }

  // Tensor t's gradient lands in its 16-bit slot on the device, as
  // ModuleHooks::land_gradient makes it land.
  void land(TensorId t, bool ok = true) {
    c10::NoGradGuard no_grad;
    const std::uint64_t began = sums.landing_began(t);
    view(p16(t), kDev).copy_(gradient(t));
    scheduler.release(p16(t), TensorState::kHoldAfterBwd);
    sums.landing_ended(t, began, ok);
  }

  void fold(const std::vector<TensorId>& ts, bool whole_chunk = true) {
    sums.fold(ts, std::vector<bool>(ts.size(), true), kHost, 1, nullptr, whole_chunk);
  }

  // After a fold of `ts` (each its window's first): the weights are the
  // masters rounded, the sums the gradients, bit for bit.
  void expect_folded(const std::vector<TensorId>& ts) {
    for (const TensorId t : ts) {
      const at::Tensor want = master_rounded(t);
      EXPECT_TRUE(at::equal(view(p16(t), kHost, AccessMode::kRead), want)) << "weights of w" << t;
      scheduler.release(p16(t), TensorState::kHold);
      EXPECT_TRUE(at::equal(view(sum(t), kHost, AccessMode::kRead), gradient(t).to(at::kFloat)))
          << "sum of w" << t;
      scheduler.release(sum(t), TensorState::kHold);
    }
  }

  std::uint64_t images() const { return scheduler.stats().images_taken_back; }

  // Folds `ts` and checks the result (expect_folded) and how it was made:
  // the images taken back, the restores made at the fold's end.
  void fold_expecting(const std::vector<TensorId>& ts, std::uint64_t images_taken, std::uint64_t late) {
    fold(ts);
    EXPECT_EQ(images(), images_taken);
    EXPECT_EQ(sums.late_restores(), late);
    expect_folded(ts);
  }

  ChunkScheduler scheduler;
  ParamBinding binding;
  GradientSums sums;
};

TEST(GradientSums, AFoldOfAChunkOnlyItsLandingsWroteTakesBackItsImage) {
  Rig r({1024, 1024});
  r.up({0, 1});
  r.land(1);
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/1, /*late=*/0);
  r.scheduler.validate();
}

TEST(GradientSums, TheSameFoldWithImagesOffRestoresFromTheMasters) {
  Rig r({1024, 1024});
  r.sums.set_use_images(false);
  r.up({0, 1});
  r.land(1);
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/0, /*late=*/0);
}

// A write to the chunk between its landings (one that reached the master,
// as the engine carries a write to a parameter: Note [Writes to a
// parameter]) makes the image stale: the fold restores from the masters.
TEST(GradientSums, AWriteBetweenTheLandingsMakesTheFoldRestore) {
  Rig r({1024, 1024});
  r.up({0, 1});
  r.land(1);
  r.set_master(1, 5.0f);
  r.scheduler.mark_written(p16(1));
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/0, /*late=*/0);
}

// A write before the first landing (the forward's own, or a user's between
// the chunk going up and backward) leaves no image of the count the
// landings began at.
TEST(GradientSums, AWriteBeforeTheLandingsMakesTheFoldRestore) {
  Rig r({1024, 1024});
  r.up({0, 1});
  r.set_master(0, 4.0f);
  r.scheduler.mark_written(p16(0));
  r.land(1);
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/0, /*late=*/0);
}

// A landing that failed part-way: its chunk's fold restores from the
// masters (what it wrote is not known to be only the gradient).
TEST(GradientSums, AFailedLandingMakesItsChunksFoldRestore) {
  Rig r({1024, 1024});
  r.up({0, 1});
  r.land(1, /*ok=*/false);
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/0, /*late=*/0);
}

// Another tensor of the chunk in use while the fold ends (its slot is read
// elsewhere): the chunk cannot change blocks under it, so the fold restores
// at its end, and that tensor's bytes stay where its reader has them.
TEST(GradientSums, AChunkWithAnotherSlotInUseRestoresAtTheFoldsEnd) {
  Rig r({512, 512, 1024});
  ASSERT_EQ(r.scheduler.store().chunk_of(p16(2)), r.scheduler.store().chunk_of(p16(0)));
  r.up({0, 1, 2});
  r.land(1);
  r.land(0);
  const at::Tensor other = r.view(p16(2), kHost, AccessMode::kRead);  // in use from here
  const at::Tensor other_before = other.clone();
  r.fold({0, 1});
  EXPECT_EQ(r.images(), 0u);
  EXPECT_EQ(r.sums.late_restores(), 1u);
  EXPECT_TRUE(at::equal(other, other_before));
  r.scheduler.release(p16(2), TensorState::kHold);
  r.expect_folded({0, 1});
  r.scheduler.validate();
}

// A fold whose tensors are in two chunks takes no image, whatever the
// caller says: each chunk's block is its own.
TEST(GradientSums, AFoldOverTwoChunksTakesNoImage) {
  Rig r({2048, 2048});
  ASSERT_NE(r.scheduler.store().chunk_of(p16(0)), r.scheduler.store().chunk_of(p16(1)));
  r.up({0, 1});
  r.land(1);
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/0, /*late=*/0);
}

// A host budget with room for the master chunk and the image but not also
// for the sums: the fold's own accesses free the image (the sums' chunk is
// made in its room), and the pass restores from the masters itself.
TEST(GradientSums, AnImageTheFoldsAccessesTookIsRestoredInThePass) {
  // (The image, the fp32 master chunk and the fp32 sums chunk: the 16-bit
  // chunk coming down takes a new block beside the image, and the sums'
  // chunk then needs the image's room.)
  Rig r({1024, 1024}, /*host_budget=*/kChunk + 2 * kChunk + 2 * kChunk);
  r.up({0, 1});
  r.land(1);
  r.land(0);
  r.fold_expecting({0, 1}, /*images_taken=*/0, /*late=*/0);
}

}  // namespace
}  // namespace tidal::hooks

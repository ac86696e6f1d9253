// Note [Chunk state machine], checked through the store: every legal
// transition is accepted, every illegal one is rejected with a message that
// names the tensor and both states, and a rejected one changes nothing.
#include "chunk/tensor_state.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "chunk/chunk_store.h"
#include "runtime/core/error.h"

namespace tidal {
namespace {

// Written out independently of the table in tensor_state.h, so a wrong
// entry there fails here.
const std::set<std::string>& legal_pairs() {
  static const std::set<std::string> pairs = {
      "FREE->FREE",           "FREE->COMPUTE",
      "COMPUTE->FREE",        "COMPUTE->HOLD",
      "COMPUTE->HOLD_AFTER_FWD", "COMPUTE->HOLD_AFTER_BWD",
      "HOLD->FREE",           "HOLD->COMPUTE",         "HOLD->HOLD",
      "HOLD_AFTER_FWD->FREE", "HOLD_AFTER_FWD->COMPUTE", "HOLD_AFTER_FWD->HOLD",
      "HOLD_AFTER_BWD->FREE", "HOLD_AFTER_BWD->COMPUTE", "HOLD_AFTER_BWD->HOLD",
  };
  return pairs;
}

std::string pair_name(TensorState from, TensorState to) {
  return std::string(to_string(from)) + "->" + to_string(to);
}

// A legal path from FREE to `state`.
std::vector<TensorState> path_to(TensorState state) {
  switch (state) {
    case TensorState::kFree:
      return {};
    case TensorState::kCompute:
      return {TensorState::kCompute};
    default:
      return {TensorState::kCompute, state};
  }
}

TEST(TensorState, NamesAreTheDocumentedOnes) {
  EXPECT_STREQ(to_string(TensorState::kFree), "FREE");
  EXPECT_STREQ(to_string(TensorState::kCompute), "COMPUTE");
  EXPECT_STREQ(to_string(TensorState::kHold), "HOLD");
  EXPECT_STREQ(to_string(TensorState::kHoldAfterFwd), "HOLD_AFTER_FWD");
  EXPECT_STREQ(to_string(TensorState::kHoldAfterBwd), "HOLD_AFTER_BWD");
}

TEST(TensorState, TableMatchesTheNote) {
  int legal = 0;
  for (TensorState from : kAllTensorStates) {
    for (TensorState to : kAllTensorStates) {
      const bool expected = legal_pairs().count(pair_name(from, to)) == 1;
      EXPECT_EQ(is_legal_transition(from, to), expected) << pair_name(from, to);
      legal += expected;
    }
  }
  EXPECT_EQ(legal, 15);
}

TEST(TensorState, EveryLegalTransitionIsAcceptedByTheStore) {
  std::vector<unsigned char> payload(4096);
  for (TensorState from : kAllTensorStates) {
    for (TensorState to : kAllTensorStates) {
      if (legal_pairs().count(pair_name(from, to)) == 0) continue;
      ChunkStore store({.chunk_bytes = 4096});
      const TensorId t = store.register_tensor("layer.weight", 100);
      const TensorRef ref{ChunkKind::kParam16, t};
      store.set_payload(store.chunk_of(ref), payload.data(), MemorySpace::kHost);
      for (TensorState step : path_to(from)) store.set_state(ref, step);
      ASSERT_EQ(store.state(ref), from);
      EXPECT_NO_THROW(store.set_state(ref, to)) << pair_name(from, to);
      EXPECT_EQ(store.state(ref), to) << pair_name(from, to);
      const Chunk& chunk = store.chunk(store.chunk_of(ref));
      EXPECT_EQ(chunk.count(to), 1u) << pair_name(from, to);
      EXPECT_EQ(chunk.movable(), to != TensorState::kCompute);
      store.validate();
    }
  }
}

TEST(TensorState, EveryIllegalTransitionIsRejectedNamingTensorAndBothStates) {
  std::vector<unsigned char> payload(4096);
  int rejected = 0;
  for (TensorState from : kAllTensorStates) {
    for (TensorState to : kAllTensorStates) {
      if (legal_pairs().count(pair_name(from, to)) == 1) continue;
      ChunkStore store({.chunk_bytes = 4096});
      store.register_tensor("other", 10);
      const TensorId t = store.register_tensor("blocks.3.mlp.bias", 100);
      const TensorRef ref{ChunkKind::kMomentum, t};
      store.set_payload(store.chunk_of(ref), payload.data(), MemorySpace::kHost);
      for (TensorState step : path_to(from)) store.set_state(ref, step);
      try {
        store.set_state(ref, to);
        ADD_FAILURE() << pair_name(from, to) << " was accepted";
      } catch (const ValueError& e) {
        const std::string msg = e.message();
        EXPECT_NE(msg.find("'blocks.3.mlp.bias'"), std::string::npos) << msg;
        EXPECT_NE(msg.find(std::string(to_string(from)) + " -> " + to_string(to)),
                  std::string::npos)
            << msg;
        EXPECT_NE(msg.find("adam_m"), std::string::npos) << msg;
        ++rejected;
      }
      EXPECT_EQ(store.state(ref), from) << "a rejected transition changed the state";
      EXPECT_EQ(store.state({ChunkKind::kParam16, t}), TensorState::kFree)
          << "another list's slot changed";
      store.validate();
    }
  }
  EXPECT_EQ(rejected, 10);
}

TEST(TensorState, SlotsOfTheFourListsAreIndependent) {
  std::vector<unsigned char> payload(8192);
  ChunkStore store({.chunk_bytes = 4096});
  const TensorId t = store.register_tensor("w", 64);
  const TensorRef p16{ChunkKind::kParam16, t};
  const TensorRef m{ChunkKind::kMomentum, t};
  store.set_payload(store.chunk_of(p16), payload.data(), MemorySpace::kHost);
  store.set_state(p16, TensorState::kCompute);
  EXPECT_EQ(store.state(m), TensorState::kFree);
  EXPECT_FALSE(store.chunk(store.chunk_of(p16)).movable());
  EXPECT_TRUE(store.chunk(store.chunk_of(m)).movable());
}

}  // namespace
}  // namespace tidal

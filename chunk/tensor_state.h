// The life cycle of a tensor's slot in a chunk list. See Note [Chunk state machine].
//
// Note [Chunk state machine]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every (list, tensor) slot has one state. The states say whether the slot
// holds data and whether an operator is using it right now:
//   FREE            no data (never written, or no longer needed); contents undefined
//   COMPUTE         an operator uses it now; its chunk is pinned where it is
//   HOLD            data valid, not in use (after init, after the optimizer step)
//   HOLD_AFTER_FWD  data valid, used in this step's forward
//   HOLD_AFTER_BWD  data valid, used in this step's backward (the gradient is in the slot)
//
// Legal transitions (row: from, column: to):
//
//                    FREE  COMPUTE  HOLD  AFTER_FWD  AFTER_BWD
//   FREE              ok     ok      -       -          -
//   COMPUTE           ok     -       ok      ok         ok
//   HOLD              ok     ok      ok      -          -
//   HOLD_AFTER_FWD    ok     ok      ok      -          -
//   HOLD_AFTER_BWD    ok     ok      ok      -          -
//
// Why:
// * Only COMPUTE writes data, so FREE leads to COMPUTE and nowhere else that
//   holds data: a slot cannot become HOLD* without having been written.
// * COMPUTE -> COMPUTE is a nested access. The pin of a chunk is a count of
//   COMPUTE slots, not of accesses, so a second access would be undone by the
//   first release; the driver has a bug and we say so.
// * Leaving COMPUTE (a release) may name any other state: the caller knows
//   whether forward, backward or the optimizer just used the slot.
// * HOLD_AFTER_FWD and HOLD_AFTER_BWD only come out of COMPUTE: they record
//   which pass used the data, which a plain reset cannot know. They go back
//   to HOLD when the step ends.
// * Any state but COMPUTE may drop to FREE (data no longer needed, e.g. the
//   gradient once the optimizer consumed it). COMPUTE may too, as a release.
// * FREE -> FREE and HOLD -> HOLD are no-ops, so bulk resets need not filter.
//
// NB: a chunk is movable only when no slot in it is COMPUTE, and may drop its
// payload only when every slot in it is FREE.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tidal {

enum class TensorState : std::uint8_t {
  kFree = 0,
  kCompute = 1,
  kHold = 2,
  kHoldAfterFwd = 3,
  kHoldAfterBwd = 4,
};

inline constexpr std::size_t kNumTensorStates = 5;
inline constexpr TensorState kAllTensorStates[kNumTensorStates] = {
    TensorState::kFree, TensorState::kCompute, TensorState::kHold, TensorState::kHoldAfterFwd,
    TensorState::kHoldAfterBwd};

constexpr std::size_t index_of(TensorState state) { return static_cast<std::size_t>(state); }

// "FREE", "COMPUTE", "HOLD", "HOLD_AFTER_FWD", "HOLD_AFTER_BWD".
const char* to_string(TensorState state);

// The table of Note [Chunk state machine].
constexpr bool is_legal_transition(TensorState from, TensorState to) {
  constexpr bool kLegal[kNumTensorStates][kNumTensorStates] = {
      //            FREE  COMPUTE HOLD   FWD    BWD
      /* FREE    */ {true, true, false, false, false},
      /* COMPUTE */ {true, false, true, true, true},
      /* HOLD    */ {true, true, true, false, false},
      /* FWD     */ {true, true, true, false, false},
      /* BWD     */ {true, true, true, false, false},
  };
  return kLegal[index_of(from)][index_of(to)];
}

// True for the states whose slot holds valid data.
constexpr bool holds_data(TensorState state) { return state != TensorState::kFree; }

}  // namespace tidal

#include "chunk/tensor_state.h"

namespace tidal {

const char* to_string(TensorState state) {
  switch (state) {
    case TensorState::kFree:
      return "FREE";
    case TensorState::kCompute:
      return "COMPUTE";
    case TensorState::kHold:
      return "HOLD";
    case TensorState::kHoldAfterFwd:
      return "HOLD_AFTER_FWD";
    case TensorState::kHoldAfterBwd:
      return "HOLD_AFTER_BWD";
  }
  return "UNKNOWN_STATE";
}

}  // namespace tidal

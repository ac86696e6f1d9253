// What user code wrote to the parameters between the engine's looks (Note
// [Writes to a parameter] in hooks/module_hooks.cpp): each parameter's version
// counter when it was last attached and detached, and whether a write since
// the last take reached its 16-bit slot ("written") or nothing ("lost").
// ModuleHooks tells it of every attach, detach and landing, and takes the
// writes for the engine (take_param_writes).
//
// Thread safety: none; ModuleHooks' thread rules.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tidal::hooks {

// What user code did to the parameters since the engine last looked:
// `written`, in-place writes the 16-bit slot holds; `assigned`, a tensor set
// as the parameter's data (`p.data = t`), returned with the parameter put
// back as it was; `lost`, in-place writes to an empty placeholder or to a
// weight made from the master (nothing holds them).
struct ParamWrites {
  std::vector<std::size_t> written;
  std::vector<std::pair<std::size_t, at::Tensor>> assigned;
  std::vector<std::size_t> lost;
};

class WriteTracker {
 public:
  // One more parameter (the next index), detached: its versions start now.
  void add(const at::Tensor& param);
  // Parameter `i` was just attached: a write since its detach hit the placeholder.
  void attached(std::size_t i, const at::Tensor& param);
  // Parameter `i`'s data is about to go to the placeholder. on_slot: its data
  // is the slot it was attached to (not a weight made from the master, not
  // data set during its use).
  void detaching(std::size_t i, const at::Tensor& param, bool on_slot);
  // A gradient lands in parameter `i`'s slot: a write the slot held (made in
  // the forward, or before a loss.backward()) that nobody carried is
  // overwritten, so lost. on_slot: `i` is attached to its slot.
  void landing(std::size_t i, const at::Tensor& param, bool on_slot);
  // The engine looks: a write since the last look counts (on_slot: an
  // attached parameter's data is its slot), and the version counts as seen.
  void look(std::size_t i, const at::Tensor& param, bool attached, bool on_slot);
  // Parameter `i`'s current version counts as seen; with forget, its writes too.
  void seen(std::size_t i, const at::Tensor& param, bool attached, bool forget);
  // Parameter `i`'s writes go to `out` and count as taken.
  void take(std::size_t i, ParamWrites& out);

 private:
  struct Versions {
    std::uint32_t attached = 0;  // the version when last attached
    std::uint32_t detached = 0;  // the version when last detached
    bool written = false;        // written while attached to its slot: the slot has it
    bool lost = false;           // written while detached (or on a weight from the master)
  };
  std::vector<Versions> versions_;  // per parameter index
};

}  // namespace tidal::hooks

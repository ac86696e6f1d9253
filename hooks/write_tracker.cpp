#include "hooks/write_tracker.h"

namespace tidal::hooks {
namespace {

// A tensor's version counter: in-place writes through it (or through views of
// it) count; Tensor::set_data keeps it, `p.data` makes another.
std::uint32_t version_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->version_counter().current_version();
}

}  // namespace

void WriteTracker::add(const at::Tensor& param) {
  Versions v;
  v.attached = v.detached = version_of(param);
  versions_.push_back(v);
}

void WriteTracker::attached(std::size_t i, const at::Tensor& param) {
  Versions& v = versions_.at(i);
  const std::uint32_t version = version_of(param);
  if (version != v.detached) v.lost = true;
  v.attached = version;
}

void WriteTracker::detaching(std::size_t i, const at::Tensor& param, bool on_slot) {
  Versions& v = versions_.at(i);
  const std::uint32_t version = version_of(param);
  if (version != v.attached) {
    if (on_slot) {
      v.written = true;
    } else {
      v.lost = true;  // a weight made from the master, or data set in a forward
    }
  }
  v.detached = version;
}

void WriteTracker::landing(std::size_t i, const at::Tensor& param, bool on_slot) {
  Versions& v = versions_.at(i);
  if (on_slot && version_of(param) != v.attached) {
    v.lost = true;
    v.attached = version_of(param);
  }
  if (v.written) {
    v.written = false;
    v.lost = true;
  }
}

void WriteTracker::look(std::size_t i, const at::Tensor& param, bool attached, bool on_slot) {
  Versions& v = versions_.at(i);
  const std::uint32_t version = version_of(param);
  if (attached) {
    if (version != v.attached) (on_slot ? v.written : v.lost) = true;
    v.attached = version;
  } else {
    if (version != v.detached) v.lost = true;
    v.detached = version;
  }
}

void WriteTracker::seen(std::size_t i, const at::Tensor& param, bool attached, bool forget) {
  Versions& v = versions_.at(i);
  (attached ? v.attached : v.detached) = version_of(param);
  if (forget) v.written = v.lost = false;
}

void WriteTracker::take(std::size_t i, ParamWrites& out) {
  Versions& v = versions_.at(i);
  if (v.written) out.written.push_back(i);
  if (v.lost) out.lost.push_back(i);
  v.written = v.lost = false;
}

}  // namespace tidal::hooks

#include "runtime/scheduler/access_trace.h"

#include <algorithm>

#include "runtime/core/error.h"

namespace tidal {

AccessTrace::AccessTrace(std::vector<TraceEntry> entries) : entries_(std::move(entries)) {
  TIDAL_CHECK(entries_.size() < std::numeric_limits<std::uint32_t>::max(),
              "access trace: ", entries_.size(), " moments in one step is more than supported");
  for (std::size_t m = 0; m < entries_.size(); ++m) {
    const ChunkId chunk = entries_[m].chunk;
    TIDAL_CHECK(chunk != kNoChunk, "access trace: moment ", m, " names no chunk");
    if (chunk >= uses_.size()) uses_.resize(static_cast<std::size_t>(chunk) + 1);
    uses_[chunk].push_back(static_cast<std::uint32_t>(m));
  }
}

std::int64_t AccessTrace::next_use(ChunkId chunk, std::int64_t moment) const {
  if (chunk >= uses_.size() || uses_[chunk].empty()) return kNever;
  TIDAL_INTERNAL_ASSERT_DEBUG_ONLY(moment >= -1, "moment ", moment);
  const auto length = static_cast<std::int64_t>(entries_.size());
  // moment = step * length + position, with position in [0, length).
  const std::int64_t step = moment >= 0 ? moment / length : -1;
  const std::int64_t position = moment - step * length;
  const auto& uses = uses_[chunk];
  auto it = std::upper_bound(uses.begin(), uses.end(), static_cast<std::uint32_t>(position));
  if (it != uses.end()) return step * length + *it;
  return (step + 1) * length + uses.front();
}

void AccessTrace::validate() const {
  std::size_t total = 0;
  for (std::size_t chunk = 0; chunk < uses_.size(); ++chunk) {
    const auto& uses = uses_[chunk];
    for (std::size_t i = 0; i < uses.size(); ++i) {
      TIDAL_INTERNAL_ASSERT(uses[i] < entries_.size() && entries_[uses[i]].chunk == chunk,
                            "trace use index: chunk ", chunk, " listed at moment ", uses[i]);
      TIDAL_INTERNAL_ASSERT(i == 0 || uses[i - 1] < uses[i], "trace uses of chunk ", chunk,
                            " not ascending");
    }
    total += uses.size();
  }
  TIDAL_INTERNAL_ASSERT(total == entries_.size(), "trace use index holds ", total, " moments of ",
                        entries_.size());
}

}  // namespace tidal

// The chunk scheduler's plan of the device budget's lowerings: chunks a
// lowering will evict leave ahead of it, and prefetches keep within it
// (Note [Chunks leave ahead of a lowering] in chunk_scheduler.h); the rest of
// the scheduler is in chunk_scheduler.cpp.
#include <algorithm>
#include <limits>

#include "runtime/core/error.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal {

std::size_t ChunkScheduler::plan_lowerings(std::vector<PlannedLowering> lowerings) {
  lowerings_.clear();
  leave_after_use_.clear();
  if (!options_.evict_ahead || !options_.prefetch || !following_ || trace_.empty()) return 0;
  // Not with a disk tier: its host is full, and a chunk down early takes
  // host room the tier's reads and writes would have had (issue 52's first
  // try: 7% more disk traffic a steady step in test_engine_nvme's bf16
  // shape). Left for the tier to plan with.
  if (disk_) return 0;
  const auto length = static_cast<std::int64_t>(trace_.size());
  for (std::size_t i = 0; i < lowerings.size(); ++i) {
    const PlannedLowering& lowering = lowerings[i];
    TIDAL_CHECK(lowering.after >= moment_ && lowering.after < length &&
                    (i == 0 || lowering.after >= lowerings[i - 1].after),
                "chunk scheduler: a planned lowering after moment ", lowering.after,
                "; expected moments in order from the current one (", moment_, ") to the step's last (",
                length - 1, ")");
  }
  lowerings_ = std::move(lowerings);
  if (lowerings_.empty()) return 0;
  play_lowerings();
  std::size_t moved = 0;
  for (const PlannedLeave& leave : leave_now_) {
    const Chunk& chunk = store_.chunk(leave.chunk);
    if (chunk.space() != MemorySpace::kDevice) continue;
    if (!chunk.movable()) {
      leave_after_use_.push_back({leave.chunk, moment_, leave.until});  // (at its release)
      continue;
    }
    if (!leave_ahead(leave)) break;
    ++moved;
  }
  debug_validate();
  return moved;
}

bool ChunkScheduler::leave_ahead(const PlannedLeave& leave) {
  const ChunkId id = leave.chunk;
  const Chunk& chunk = store_.chunk(id);
  RoomRequest request;
  request.space = MemorySpace::kDevice;
  request.bytes = chunk.capacity_bytes();
  request.prefetch = true;  // no error without host room: it stays for its lowering instead
  request.needed_at = trace_.next_use(id, moment_);
  const bool moves = !chunk.all_free();  // (else its payload is dropped)
  if (moves) {
    // Not into the host's swap room (as an eviction: eviction_host_budget).
    const std::size_t live = pool_.held_bytes(MemorySpace::kHost) - pool_.cached_bytes(MemorySpace::kHost);
    const std::size_t room = eviction_host_budget(kNoChunk);
    if (live > room || chunk.capacity_bytes() > room - live) return false;
  }
  if (!evict(id, request)) return false;
  if (moves) {
    ++stats_.evictions_ahead;
    // Until its lowering, neither the cursor nor send_ahead brings it back.
    slots_[id].down_until = leave.until;
    held_down_.push_back(id);
  }
  return true;
}

bool ChunkScheduler::held_down(ChunkId id) const {
  return slots_[id].down_until >= moment_;
}

void ChunkScheduler::clear_plan() {
  lowerings_.clear();
  leave_after_use_.clear();
  for (ChunkId id : held_down_) slots_[id].down_until = kNotHeldDown;
  held_down_.clear();
}

void ChunkScheduler::leave_after_use(ChunkId id) {
  const auto planned = std::find_if(leave_after_use_.begin(), leave_after_use_.end(),
                                    [&](const PlannedLeave& p) { return p.chunk == id; });
  if (planned == leave_after_use_.end() || planned->after > moment_) return;
  const PlannedLeave leave = *planned;
  leave_after_use_.erase(planned);
  if (store_.chunk(id).space() == MemorySpace::kDevice && store_.chunk(id).has_payload()) leave_ahead(leave);
}

void ChunkScheduler::play_lowerings() {
  // Plays the step forward from now as the trace and the plan say it goes
  // (Note [Chunks leave ahead of a lowering]). playing_[id]: kAway (not on
  // the device), kUntouched (there now, no access since), else the moment
  // of its latest access. Only what leaves before the next lowering (the
  // next trace point, where the plan is made again) matters here: the play
  // stops once no chunk in the room was last used before that.
  constexpr MemorySpace kDevice = MemorySpace::kDevice;
  constexpr std::int64_t kAway = -2;
  constexpr std::int64_t kUntouched = -1;
  const std::int64_t horizon = lowerings_.front().after;
  leave_now_.clear();
  playing_.assign(slots_.size(), kAway);
  // Recency as the play goes (LRU, and OPT's ties among chunks never used again).
  played_use_ = last_use_;
  std::uint64_t tick = tick_;
  std::vector<ChunkId> room(resident_[index_of(kDevice)].begin(), resident_[index_of(kDevice)].end());
  std::size_t bytes = store_.bytes_in(kDevice);
  for (ChunkId id : room) playing_[id] = kUntouched;
  std::size_t early = room.size();  // chunks in the room last used by the horizon
  const auto is_early = [&](std::int64_t state) { return state != kAway && state <= horizon; };
  std::size_t budget = budget_[index_of(kDevice)];

  // Evicts by the policy as of `moment` until the room holds `limit` bytes;
  // `keep` (the chunk an access brings in) stays. A lowering's victims leave
  // ahead of it: now, or after their latest access before it.
  const auto evict_down_to = [&](std::size_t limit, std::int64_t moment, ChunkId keep, const PlannedLowering* lowering) {
    while (bytes > limit) {
      candidates_.clear();
      for (ChunkId id : room) {
        if (id != keep) candidates_.push_back(id);
      }
      if (candidates_.empty()) return;
      const EvictionContext context(store_, &trace_, moment, played_use_);
      const ChunkId victim = policy_->choose_victim(context, kDevice, candidates_);
      std::erase(room, victim);
      bytes -= store_.chunk(victim).capacity_bytes();
      std::int64_t& state = playing_[victim];
      if (is_early(state)) --early;
      if (lowering != nullptr && state == kUntouched) leave_now_.push_back({victim, moment_, lowering->after});
      if (lowering != nullptr && state > kUntouched && state <= horizon) {
        leave_after_use_.push_back({victim, state, lowering->after});
      }
      state = kAway;
    }
  };

  const auto length = static_cast<std::int64_t>(trace_.size());
  std::size_t next = 0;
  // Only the next kPlayedLowerings lowerings: a chunk a later one takes
  // leaves when that one comes within them, still that many trace points
  // ahead, and a play costs what that stretch of the step does, not the
  // whole rest of it (a 48-layer GPT, 1,837 accesses a step: 19 us a point
  // for the whole rest, 3 us with 64; with 16, step_overlap_clip's GPT on a
  // 1 GB/s link waited for twice as many copies: the chunks its head's
  // logits take then left too late to be copied in time).
  const std::size_t played = std::min(lowerings_.size(), kPlayedLowerings);
  for (std::int64_t t = moment_; next < played && (t <= horizon || early > 0); ++t) {
    if (t > moment_) {
      if (t >= length) break;
      const TraceEntry& entry = trace_.at(t);
      std::int64_t& state = playing_[entry.chunk];
      if (is_early(state)) --early;
      if (entry.space == kDevice) {
        if (state == kAway) {
          room.push_back(entry.chunk);
          bytes += store_.chunk(entry.chunk).capacity_bytes();
        }
        state = t;
        played_use_[entry.chunk] = ++tick;
        if (is_early(state)) ++early;
        evict_down_to(budget, t - 1, entry.chunk, nullptr);
      } else if (state != kAway) {
        std::erase(room, entry.chunk);
        bytes -= store_.chunk(entry.chunk).capacity_bytes();
        state = kAway;
      }
    }
    for (; next < played && lowerings_[next].after == t; ++next) {
      budget = lowerings_[next].bytes;
      evict_down_to(budget, t, kNoChunk, &lowerings_[next]);
    }
  }
}

std::size_t ChunkScheduler::planned_budget_before(std::int64_t needed_at) const {
  std::size_t lowest = std::numeric_limits<std::size_t>::max();
  for (const PlannedLowering& lowering : lowerings_) {
    if (lowering.after >= needed_at) break;
    if (lowering.after >= moment_) lowest = std::min(lowest, lowering.bytes);
  }
  return lowest;
}

}  // namespace tidal

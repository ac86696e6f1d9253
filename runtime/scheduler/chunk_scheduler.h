// The chunk scheduler: moves chunks between host and device memory as
// tensors are used, within a memory budget per space, evicting by a
// pluggable policy (OPT from the access trace, LRU without one) and
// prefetching the next chunks of the trace on a copy stream.
//
// Note [Moments and the trace]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every access() is one moment; moments count from 0 in each step and
// end_step() closes a step. The scheduler records the (chunk, space)
// sequence of a step and, at end_step(), adopts it as the trace when there
// was none or when the step departed from the trace (another chunk at some
// moment, or another length). While a step follows the trace, OPT knows each
// chunk's next use and prefetch knows what comes next; the moment it
// departs, eviction falls back to LRU and prefetch stops until the next step
// starts on the newly adopted trace. Following costs a comparison per
// access; recording starts only on departure (the prefix is the trace's).
//
// Note [Chunk budgets]
// ~~~~~~~~~~~~~~~~~~~~
// A budget bounds all chunk memory the scheduler holds in a space: payloads
// of resident chunks, blocks still being copied from, and free blocks kept
// for reuse (Note [Block fences] in block_pool.h). Before it grows, the
// scheduler frees cached blocks whose copies are done, then, where freeing
// the others would make the room, those (waiting for their copies), and
// otherwise evicts chunks (device -> host) in the policy's order; resident
// bytes never exceed the budget. Host chunks
// go to the device only where it has free room (Note [One place per
// chunk]); otherwise a full host budget is an error at once. When no chunk
// is movable (all pinned by COMPUTE slots), access() throws
// OutOfMemoryError naming the chunk it needed, the budget, the resident
// bytes and what is pinned. A budget lowered with BlockFrees::kWhenNeeded is
// the one exception to "all": Note [Blocks leaving over a lowered budget].
//
// Note [Blocks leaving over a lowered budget]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// (Device only; the host frees cached blocks before it evicts, as above.)
// The memory tracer lowers the device budget at a trace point for the
// activations of the interval that starts there (Note [The memory tracer]).
// The chunks over the new budget leave at once (their copies down start on
// the copy stream), but their device blocks are busy until those copies
// land, so freeing the blocks there, as set_budget does, made the hook's
// thread wait for each copy: a synchronous eviction, the link time of every
// chunk evicted in a steady step (block_waits; issue 52: 12 of the 16
// evictions of step_overlap_clip's clip_all step waited). With kWhenNeeded
// the lowering frees only blocks whose copies are done and leaves the others
// cached, over the budget, until someone needs their room: an activation
// that finds no room (the room maker, hooks/device_room.h, frees them first,
// ready ones first), a chunk that needs device room (make_room frees them
// where that makes the room; otherwise a chunk must leave anyway, and its
// block may serve), or the next lowering. By then the copy has had the compute
// since the point to land. Meanwhile they count as held, so the non-chunk
// limit the tracer sets (the limit less the chunk bytes held) leaves the
// device's total within its budget at every moment; only chunks are kept to
// the lowered budget: a cached block is reused for a chunk only while the
// resident bytes stay within it (reuse_block).
//
// Note [Chunks leave ahead of a lowering]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Leaving a lowering's blocks to whoever needs their room (above) moves the
// wait but does not shorten it: the interval a lowering makes room for
// allocates its activations at once, and they need the blocks whose copies
// down only started at the lowering (issue 52: 13-14 block waits a steady
// step in step_overlap_clip's GPT on a 1 GB/s link, 14 ms of a 131 ms
// step). So the memory tracer tells the scheduler, at each trace point, the
// lowerings still to come in the step (plan_lowerings: from the last step's
// record, the budget each later point will set and the moment of the access
// before it), and the chunks they will evict leave at their last use before
// them, so each copy runs under the compute of every interval between. Which
// chunks: the scheduler plays the step forward from the trace (the device's
// resident chunks now; an access brings its chunk in, evicting by the
// policy as of the moment before it when over the budget in force, or takes
// it out when it wants the chunk elsewhere; each lowering evicts by the
// policy as of its moment, with the recency the play gives, until the rest
// fit). A victim of a lowering that no access uses before it leaves now (in
// use now: at its release); one still to be used leaves at the release that
// ends its last use before the lowering (release(): no waiting for the next
// trace point, which may be the lowering itself). These are the lowering's
// own choices as the play sees them (evicting "what is not used before the
// lowering" instead throws out chunks the next interval needs, and moves
// more). The play leaves out payload drops, chunks sent ahead, the host's
// room and the device ceiling; where those change the lowering's choice a
// chunk may leave that it would have kept, which is why the tests and
// benchmarks/evict_ahead.py compare the bytes moved with the plan off. And
// until a lowering, a prefetch for a use after it keeps within its budget,
// as the access it serves will, and a chunk that left ahead of it does not
// come back before it (held_down: the cursor waits there, send_ahead
// declines): otherwise the cursor would fill the room again with the chunks
// the lowering takes (a scratch run evicting one point ahead without that
// cap moved 8 MiB more a step: chunks went down, up and down again). At the
// step's point the tracer plans the next step's points.
//
// Only while the step follows the trace with prefetch on (and evict_ahead),
// and without a disk tier (its host is full: chunks down early took host
// room the tier's traffic had, 7% more disk bytes a step in
// test_engine_nvme's bf16 shape). A chunk the host has no room for (as an
// eviction's: Note [Swaps through the host's last chunk]) stays for its
// lowering. The play stops at the first point where nothing in the room was
// last used before the next lowering (the plan is made again there), or
// after 64 lowerings (kPlayedLowerings). What this cannot hide: a chunk
// used right before a lowering that must take it (the last block's weights
// before a GPT's head, whose logits take the room) leaves only then.
//
// Note [One place per chunk]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk's payload lives in one memory space at a time, as in PatrickStar:
// when a chunk moves to the device its host block goes back to the pool, and
// the pool keeps as many free host blocks as a steady step takes (Note
// [Host blocks for a steady step]; at least host_cache_blocks); the rest are
// freed as soon as their copies have completed (BlockPool::trim_ready, never
// a wait), and the kept ones go first when the host budget needs room. So
// host memory holds the host-resident chunks plus the blocks a step reuses,
// and the largest model is bounded by host + device memory, not by host
// memory alone.
//
// The converse makes that bound reachable: when the host budget is full and
// a chunk needs host room (it is materialized there, or wanted there by CPU
// compute), the scheduler spills a movable host chunk to the device, chosen
// by the eviction policy, if the device budget has free room for it; a spill
// never evicts a device chunk (that would only move the shortage back), and
// making host room for a device eviction never spills (the two would chase
// each other). A spilled chunk is an ordinary device chunk afterwards: the
// device evicts it back when the host has room again. Counted in
// ChunkSchedulerStats::spills. With a disk tier, only chunks of lists kept
// off disk spill: the others go to disk (Note [Chunks on NVMe: the tier]),
// so the device's free room is left to the chunks that have nowhere else to
// go (a master spilled there would later need host room to leave, which a
// host full of 16-bit chunks cannot give).
//
// A move to the device frees its host block only after it has device room,
// and the device makes room by evicting to the host: with both full, nothing
// can move. So host_eviction_reserve_bytes of the host budget are for moves
// down only (evictions, chunks wanted on the host for CPU compute): a chunk
// materialized on the host (new bytes) spills once the host holds budget -
// reserve, and the reserve is there for the moves that make the device's
// working room. Evictions stop one fp32 chunk short of the host budget; that
// last chunk's room is for swaps (Note [Swaps through the host's last chunk]
// in chunk_scheduler.cpp). A step fills it (the CPU Adam brings 16-bit chunks down), so
// end_step() gives it back: host chunks go up into free device room, never
// evicting, those the next step uses first first (they would come up anyway),
// until the host holds at most budget - reserve. And a device chunk the host
// cannot take is not chosen as a victim while another can go (Note [Victims
// the host can take] in chunk_scheduler.cpp).
//
// Note [Pinned at the second crossing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Pinning a host block (cudaHostRegister) costs about 6 GB/s on an H100's
// host, some eight times what copying the same bytes over the link costs,
// while a copy from pageable memory costs about the link time again with
// the host waiting for it. So pinning pays only for a block that crosses
// the link again and again, and most host blocks never cross: the states
// CPU Adam updates where they live, a model's chunks materialized on the
// host. A host block is therefore made pageable, and the host block of a
// chunk is pinned at the chunk's second counted copy over the link (move(),
// BlockPool::prepare_crossing); copies in the first step (the warm-up: it
// follows no plan, and most of its moves, states going up to be updated and
// the model's chunks going up once, do not repeat) are not counted. A copy
// through a block not pinned runs pageable (pageable_copies; the host waits
// for it, as CUDA's cudaMemcpyAsync from pageable memory makes it). The
// count is the chunk's, not the block's: blocks go from chunk to chunk
// through the cache, and what repeats is a chunk's trip (gradients down,
// weights up, every step), while the states that come down once for CPU
// Adam after the warm-up do not. The cache hands a chunk that crosses again
// a pinned block and any other chunk one not pinned, when it has one
// (BlockPool::take_cached), so the pinned blocks stay with the chunks that
// move and a steady step pins nothing (host_pins counts what was pinned).
// Before, every host block was pinned when made: initializing the quarter-
// budget shape at the H100's pinning rate pinned all 25.7 MB of it (29 s on
// the simulated device, 18x a steady step), most of it never to cross.
// Pinning the blocks a steady step moves costs, at that rate, about 2.5
// plain steps wherever it happens; here it is the second and third steps.
//
// Note [Host blocks for a steady step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host block a step copies through is pinned (Note [Pinned at the second
// crossing]; 2 GB of chunks going down and up every step would pin for a
// third of a second each step on an H100's host). A steady step moves the same chunks
// down every step (CPU Adam's gradients, evictions) and up again (the next
// forward), and makes the same chunks afresh (gradient sums), so the host
// keeps as many free blocks as each of the last two steps took from the pool
// (never fewer than host_cache_blocks), size by size: the next step's takes reuse them and
// nothing is pinned once the trace repeats, while blocks a step took once
// (the model's first materialization, chunks going up for good) go back. They are counted
// in the host budget like any block held, so a host short of room frees
// them first (make_room trims before it evicts or spills).
// Until two steps have ended, every free block is kept: the first step runs
// without a trace (its chunks go up where the device has room, their blocks,
// pinned when the model was materialized, come free) and the second follows
// the first plan (states coming down for CPU Adam): each takes blocks the
// other gave back, and a block freed there would be pinned again a moment
// later (issue 52: the first two steps spent 2-3 steady steps each pinning
// at an H100 host's 6 GB/s). They hold no more host memory than the model
// held when it was materialized.
//
// Note [Prefetch]
// ~~~~~~~~~~~~~~~
// After each access that follows the trace, a cursor walks the trace ahead
// (into the next step, at most one step ahead) and starts the move of each
// chunk that is not where its next use wants it, in order, while fewer than
// prefetch_depth prefetched chunks wait for their access. A prefetch uses
// free budget, or evicts now the chunk that the access needing the
// prefetched chunk would evict then: the policy chooses among all resident
// chunks as of that moment, and the prefetch goes ahead only if the choice
// is movable now and not used before that moment. So it never evicts
// anything needed sooner, and with OPT it moves the same chunks as demand
// paging would, only earlier (evicting "anything used later" instead would
// shrink the cache the steady working set lives in, and move more). It stops
// at the first chunk it cannot place: order is kept, nothing is skipped.
// Nor does a prefetch to the device wait for the blocks a lowering left
// (Note [Blocks leaving over a lowered budget]): where the only blocks it
// could free are cached ones still being copied out of while some are over
// the budget, it stops there, and the cursor tries again after the next
// access (a prefetch waiting for them made the hook's thread wait for
// the copies of the chunks a lowering had just evicted: 20-25 waits a step
// in step_overlap_clip's clip_all). A prefetch to the host (from disk) still
// waits, which keeps the disk tier's traffic the same from run to run.
// The cursor passes chunks already in place; when such a chunk leaves its
// place before the use the cursor passed (a budget that shrinks at a trace
// point evicts it, or a demand access does), the cursor goes back to that
// use, so the chunk is fetched ahead again rather than missed. The
// copy runs on the scheduler's copy stream; the chunk's block fence records
// its end, and access() waits only on the fence of the chunk it returns.
//
// Note [A pin that does not wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CPU Adam's worker (python/tidal/engine/overlap.py) updates chunks that the
// engine's thread pins on the host. A pin of a chunk whose gradients are on
// the device starts its copy down; waiting for it there would stop backward
// (the gradient hook runs on the autograd thread) for the copy's whole time,
// which is the link time of every gradient CPU Adam takes. So such a pin
// passes wait_for_copy false: the chunk is placed and in use (COMPUTE, it
// cannot move) and the caller gets copy_fence(), the block's fence, to
// synchronize on the worker before it reads. The fence belongs to the block,
// which stays with the chunk while it is in use, and nothing records on it
// meanwhile (a copy out of a block in use waits for its release). A block
// with disk I/O still running is waited for as before (the I/O has no fence).
//
// Thread safety: none; one thread drives a scheduler (the hooks run on the
// Python thread). The device's copy streams run concurrently, ordered by
// block fences.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chunk/chunk_store.h"
#include "runtime/device/device.h"
#include "runtime/scheduler/access_trace.h"
#include "runtime/scheduler/block_pool.h"
#include "runtime/scheduler/disk_tier.h"
#include "runtime/scheduler/eviction_policy.h"

namespace tidal {

// What the caller of access() does with the slot while it holds it. A write
// (the default: if in doubt, a write) makes the chunk's copy on disk stale
// (Note [Chunks on NVMe: clean chunks] in disk_tier.h); a read promises that
// nothing writes the chunk's bytes until the release, or that mark_written()
// says so before it.
enum class AccessMode : std::uint8_t { kRead, kWrite };

// When set_budget frees the cached blocks over a lowered budget: at once,
// waiting for the copies still running out of them, or as their room is
// needed (Note [Blocks leaving over a lowered budget]).
enum class BlockFrees : std::uint8_t { kNow, kWhenNeeded };

// A lowering of the device budget still to come in this step (Note [Chunks
// leave ahead of a lowering]): after the access at moment `after`, the
// budget becomes `bytes`.
struct PlannedLowering {
  std::int64_t after = 0;
  std::size_t bytes = 0;
};

struct ChunkSchedulerOptions {
  // See Note [Chunk budgets]. 0 for the device means its capacity().
  std::size_t device_budget_bytes = 0;
  std::size_t host_budget_bytes = std::numeric_limits<std::size_t>::max();
  // Record each step's access sequence and follow it (OPT, prefetch).
  bool use_trace = true;
  // See Note [Prefetch]. Needs use_trace.
  bool prefetch = true;
  // Prefetched chunks that may wait for their access at a time.
  std::size_t prefetch_depth = 4;
  // Note [Chunks leave ahead of a lowering]: plan_lowerings moves chunks off
  // ahead of their lowering and keeps prefetches within it. Needs prefetch.
  // Off (for comparison): a plan is ignored.
  bool evict_ahead = true;
  // Pin host payloads through the device (CUDA: cudaHostRegister).
  bool pin_host_memory = true;
  // Give a chunk's payload back when all of its slots become FREE.
  bool drop_free_chunks = true;
  // Free host blocks kept for reuse at least; see Note [One place per
  // chunk] and Note [Host blocks for a steady step].
  std::size_t host_cache_blocks = 4;
  // Host bytes only chunks moving down from the device may fill; see Note
  // [One place per chunk].
  std::size_t host_eviction_reserve_bytes = 0;
  // Non-owning; must outlive the scheduler. When set, device work after
  // access() is ordered after the chunk's copy by making this stream wait
  // (CUDA: the stream torch computes on), and release() records there when
  // a chunk stops being pinned, so a later copy out waits for that compute.
  // When null the host computes: access() blocks until the copy has landed.
  Stream* compute_stream = nullptr;
  // Null: OptPolicy.
  std::shared_ptr<EvictionPolicy> policy;
  // The disk tier (Note [Chunks on NVMe: the tier] in disk_tier.h): chunks
  // of the lists in disk_kinds (bit index_of(kind)) go to a file in this
  // folder when the host is full. Empty: no disk tier (a full host is an
  // error, as before).
  std::string disk_path;
  // Bytes of the file at most; 0: the file system's free space less 10%.
  std::size_t disk_budget_bytes = 0;
  std::uint8_t disk_kinds = disk_kind_bits({ChunkKind::kParam32, ChunkKind::kMomentum, ChunkKind::kVariance});
  int disk_threads = 8;
  std::size_t disk_request_bytes = std::size_t{1} << 20;
  // A folder whose file system has no O_DIRECT (tmpfs): buffered I/O instead of an error.
  bool disk_allow_buffered = false;
  DirectIoBackend disk_backend = DirectIoBackend::kThreads;
  // Note [Chunks on NVMe: clean chunks] in disk_tier.h: a chunk whose home
  // still holds its bytes goes to disk without a write. Off: every chunk is
  // written (for comparison: benchmarks/nvme_train.py).
  bool disk_skip_clean_writes = true;
  // Note [A clean chunk goes down without a copy]: a chunk leaving the
  // device unchanged since its copy up takes back the host block it came
  // from, when the pool still has it. Off: every move down copies (for
  // comparison: benchmarks/clean_down.py). Not with a disk tier.
  bool skip_clean_copies = true;
  // The pools (bit i: pool i, ChunkStore::register_tensor) whose chunks may
  // skip that copy; the engine names the trainable pool only.
  std::uint8_t clean_copy_pools = 0xff;

  static constexpr std::uint8_t disk_kind_bits(std::initializer_list<ChunkKind> kinds) {
    std::uint8_t bits = 0;
    for (ChunkKind kind : kinds) bits = static_cast<std::uint8_t>(bits | (1u << index_of(kind)));
    return bits;
  }
};

struct ChunkSchedulerStats {
  std::uint64_t accesses = 0;
  std::uint64_t releases = 0;
  // accesses = hits + prefetch_hits + misses + materializations.
  std::uint64_t hits = 0;              // chunk already in place, not by prefetch
  std::uint64_t prefetch_hits = 0;     // chunk in place because a prefetch moved it
  std::uint64_t misses = 0;            // access moved the chunk itself (a prefetch miss)
  std::uint64_t materializations = 0;  // access gave a chunk without payload a fresh one
  std::uint64_t prefetches = 0;        // moves started by prefetch
  std::uint64_t prefetches_wasted = 0; // prefetched chunks evicted or dropped before use
  std::uint64_t evictions = 0;         // chunks moved off the device to make room
  std::uint64_t spills = 0;            // chunks moved to the device to make room on the host
  std::uint64_t payload_drops = 0;     // payloads given back (all slots FREE)
  std::uint64_t copy_waits = 0;        // accesses that waited for a copy (timing-dependent)
  // Seconds the calling thread spent in those waits: the link time a step
  // did not hide (on a device with a compute stream, device accesses order
  // the stream instead and only host accesses wait here).
  double copy_wait_seconds = 0;
  // New blocks: a steady step reuses cached blocks instead (Note [Host
  // blocks for a steady step]).
  std::uint64_t host_block_allocations = 0;
  std::uint64_t host_block_bytes_allocated = 0;
  std::uint64_t device_block_allocations = 0;
  // Host blocks pinned at their second crossing of the link, and their
  // bytes; copies through a host block not pinned (Note [Pinned at the
  // second crossing]). A steady step pins nothing.
  std::uint64_t host_pins = 0;
  std::uint64_t host_bytes_pinned = 0;
  std::uint64_t pageable_copies = 0;
  // Frees of cached blocks that blocked the thread on a running copy, and
  // the seconds they blocked it (beside copy_wait_seconds: the link time a
  // step did not hide).
  std::uint64_t block_waits = 0;
  double block_wait_seconds = 0;
  // Bytes of cached blocks a lowering left over the budget, their copies out
  // still running (Note [Blocks leaving over a lowered budget]).
  std::uint64_t bytes_left_leaving = 0;
  // The prefetch cursor went back to a chunk that left its place after the
  // cursor had passed it (Note [Prefetch]).
  std::uint64_t prefetch_rewinds = 0;
  // Chunks moved off the device ahead of the lowering that evicts them
  // (Note [Chunks leave ahead of a lowering]; also counted in evictions).
  std::uint64_t evictions_ahead = 0;
  // Prefetches to the device that stopped, finding only cached blocks still
  // being copied out of, instead of waiting for them (Note [Prefetch]; those
  // blocks would not always have made the room); the cursor tried again
  // after the next access.
  std::uint64_t prefetches_put_off = 0;
  // Moves started by send_ahead (also counted in prefetches).
  std::uint64_t prefetches_ahead = 0;
  std::uint64_t moves_host_to_device = 0;
  std::uint64_t moves_device_to_host = 0;
  std::uint64_t bytes_host_to_device = 0;
  std::uint64_t bytes_device_to_host = 0;
  std::uint64_t moves_host_to_disk = 0;  // writes of chunks to the disk tier
  std::uint64_t moves_disk_to_host = 0;  // reads of chunks back (prefetched ones included)
  std::uint64_t bytes_host_to_disk = 0;
  std::uint64_t bytes_disk_to_host = 0;
  // Chunks that went to disk without a write: their home held their bytes
  // (Note [Chunks on NVMe: clean chunks] in disk_tier.h); not in the two above.
  std::uint64_t disk_writes_skipped = 0;
  std::uint64_t bytes_disk_writes_skipped = 0;
  // Chunks that left the device without a copy: the host block they came up
  // from still held their bytes (Note [A clean chunk goes down without a
  // copy]); counted in moves_device_to_host (and evictions, where they were
  // evicted), not in bytes_device_to_host.
  std::uint64_t copies_down_skipped = 0;
  std::uint64_t bytes_down_skipped = 0;
  // Host chunks that took back the block they went up from in place of a
  // rewrite of their bytes (take_back_image: Note [The weights' image
  // instead of the restore] in hooks/gradient_sums.h).
  std::uint64_t images_taken_back = 0;
  std::uint64_t bytes_images_taken_back = 0;
  // Host blocks allocated because every cached one of the size held an
  // image someone would take back (Note [Images someone still wants] in
  // chunk_scheduler.cpp).
  std::uint64_t blocks_for_images = 0;
  std::uint64_t steps = 0;
  std::uint64_t trace_adoptions = 0;   // end_step() took a new trace (first one included)
  std::uint64_t trace_divergences = 0; // steps that departed from the trace
  // Indexed by index_of(MemorySpace); the kNone entry stays 0.
  std::array<std::size_t, kNumMemorySpaces> resident_bytes{};
  std::array<std::size_t, kNumMemorySpaces> peak_resident_bytes{};
  std::array<std::size_t, kNumMemorySpaces> held_bytes{};  // resident + cached blocks; disk: the file
  std::array<std::size_t, kNumMemorySpaces> budget_bytes{};
};

class ChunkScheduler {
 public:
  // Takes the store; its chunks must hold no payload yet (a fresh store).
  ChunkScheduler(ChunkStore store, std::shared_ptr<Device> device,
                 ChunkSchedulerOptions options = {});
  ~ChunkScheduler();
  ChunkScheduler(const ChunkScheduler&) = delete;
  ChunkScheduler& operator=(const ChunkScheduler&) = delete;

  const ChunkStore& store() const { return store_; }
  Device& device() const { return *device_; }
  const ChunkSchedulerOptions& options() const { return options_; }

  // Registers a tensor in the store (ChunkStore::register_tensor); allowed
  // at any time, e.g. while a model is built straight into chunks.
  TensorId register_tensor(std::string name, std::size_t numel, std::uint8_t pool = 0,
                           bool with_previous = false);
  // The store's warning channel (ChunkStore::set_warning_handler, take_warnings).
  void set_warning_handler(WarningHandler handler) { store_.set_warning_handler(std::move(handler)); }
  std::vector<std::string> take_warnings() { return store_.take_warnings(); }

  // Makes the chunk of `ref` resident in `space` (kHost or kDevice), moving
  // it and evicting others as needed, marks the slot COMPUTE and returns the
  // address of its first element, valid until the slot is released. The
  // state must allow COMPUTE (Note [Chunk state machine]); a slot that was
  // FREE has undefined contents for the caller to write. Throws
  // OutOfMemoryError when no room can be made (Note [Chunk budgets]) and
  // ValueError when the chunk is pinned by COMPUTE in the other space;
  // nothing changes state then. `mode`: see AccessMode; an access of a slot
  // that was FREE is a write whatever `mode` says. With wait_for_copy false
  // a host access returns while a copy into the chunk's block may still run
  // (Note [A pin that does not wait]): the caller waits on copy_fence()
  // before it reads.
  void* access(TensorRef ref, MemorySpace space, AccessMode mode = AccessMode::kWrite,
               bool wait_for_copy = true);
  // Something wrote (or will write) the chunk of `ref` outside a write
  // access: its copy on disk is stale (Note [Chunks on NVMe: clean chunks]).
  // No-op for a chunk on disk (only the tier writes its home).
  void mark_written(TensorRef ref);
  // Whether chunk `id`'s home on disk holds the bytes its payload holds, so
  // that it may go to disk without a write (Note [Chunks on NVMe: clean
  // chunks]). False without a disk tier.
  bool disk_copy_current(ChunkId id) const;
  // Ends the use of a COMPUTE slot; `state` is any legal successor (FREE,
  // HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD). A chunk the plan has leave after
  // this use starts down (Note [Chunks leave ahead of a lowering]).
  void release(TensorRef ref, TensorState state);
  // release(), and where it leaves the chunk with no slot in use, the chunk
  // takes back its image of write count `version` (take_back_image) before
  // anything can move it. Whether it did.
  bool release_taking_image(TensorRef ref, TensorState state, std::uint64_t version);
  // Transitions between states outside COMPUTE (HOLD_AFTER_* -> HOLD,
  // anything -> FREE); access()/release() enter and leave COMPUTE.
  void set_state(TensorRef ref, TensorState state);
  // Closes a step. See Note [Moments and the trace].
  void end_step();

  // Changes a budget; shrinking evicts (device) or frees cached blocks until
  // the held bytes fit, and throws OutOfMemoryError, leaving the budget as it
  // was, when they cannot. With BlockFrees::kWhenNeeded, cached blocks whose
  // copies still run stay over the budget (Note [Blocks leaving over a
  // lowered budget]); only the resident bytes must fit.
  void set_budget(MemorySpace space, std::size_t bytes, BlockFrees frees = BlockFrees::kNow);
  // Frees one cached block of `space` if the held bytes exceed its budget
  // (blocks a kWhenNeeded lowering left), one whose copy is done first, else
  // after waiting for the oldest. Returns whether it freed one.
  bool free_leaving_block(MemorySpace space);
  // Note [Chunks leave ahead of a lowering]: the device budget's changes
  // still to come in this step, in the order of their moments (none before
  // the current one), replacing the last plan; end_step() and a departure
  // from the trace drop it. Moves off the device now the chunks those
  // lowerings will evict that nothing uses before them, and returns how
  // many; those used before them leave at the release that ends their last
  // use before. Keeps no plan unless the step follows the trace with
  // prefetch and evict_ahead on.
  std::size_t plan_lowerings(std::vector<PlannedLowering> lowerings);
  std::size_t budget(MemorySpace space) const { return budget_[index_of(space)]; }
  // The most chunk bytes the device may hold now beside its other bytes (the
  // engine's memory tracer: the budget less the margin less the non-chunk
  // bytes live now); chunks that would grow past it wait or fail, as past
  // the budget. Null: none. Note [Chunks in use and activations share one
  // budget] in runtime/tracer/memory_tracer.h.
  void set_device_ceiling(std::function<std::size_t()> ceiling) { ceiling_ = std::move(ceiling); }

  // Note [Sent ahead of the cursor]: starts the move of chunk `id` to where
  // its next use in the trace wants it, now, ahead of the prefetch cursor
  // and outside its order: for a chunk the caller knows is final until that
  // use (CPU Adam's worker has just updated it) while the cursor is held back
  // by chunks that are not (Note [Weights up as they are updated] in
  // python/tidal/engine/overlap.py). The room is a prefetch's: free budget,
  // or the victim the use itself would evict, only when it is movable now
  // and not used before that use (Note [Prefetch]); the move counts as a
  // prefetch, hit at that use, but not against prefetch_depth. Records no
  // access and moves no moment, so the trace is followed as before. False,
  // with nothing changed, when it cannot start now: no trace followed,
  // prefetch off, the chunk in use, without payload, already where that use
  // wants it or never used again, or no such room.
  bool send_ahead(ChunkId id);
  // The chunks send_ahead moved that were evicted for room before the use
  // they were sent for, since the last call, in that order: a caller that
  // sends ahead learns which sends the room did not keep (Note [Sent ahead
  // and evicted] in python/tidal/engine/overlap.py).
  std::vector<ChunkId> take_ahead_wasted() { return std::exchange(ahead_wasted_, {}); }

  // Moment of the latest access in this step (-1 before the first).
  std::int64_t moment() const { return moment_; }
  bool following_trace() const { return following_; }
  const AccessTrace& trace() const { return trace_; }
  // Whether chunk `id`'s payload has no copy pending (true without payload).
  bool chunk_ready(ChunkId id) const;
  // The fence of a copy into chunk `id`'s block still running, or null.
  // Note [A pin that does not wait]: valid while the chunk is in use
  // (COMPUTE), and synchronize() may be called on it from any thread.
  const Event* copy_fence(ChunkId id) const;

  // Everything that may have changed chunk `id`'s bytes counts here (Note [A
  // clean chunk goes down without a copy]): equal counts, equal bytes.
  std::uint64_t write_count(ChunkId id) const;
  // Whether the pool caches the host block chunk `id` went up from when its
  // write count was `version`, holding its bytes as they were then.
  bool image_cached(ChunkId id, std::uint64_t version) const;
  // Host chunk `id` (no slot in use) takes that block back as its payload,
  // its bytes again as of `version`; the block it had goes to the pool. For
  // a caller that knows the only writes since were to be undone (Note [The
  // weights' image instead of the restore] in hooks/gradient_sums.h). Counts
  // as a write. False, with nothing changed, when the chunk is not on the
  // host, a slot of it is COMPUTE or the block is not cached.
  bool take_back_image(ChunkId id, std::uint64_t version);
  // A later take_back_image(id, version) is expected (a fold of chunk `id`'s
  // gradients whose landings began at write count `version`), or no longer
  // is: the pool hands out and frees images nobody expects first (Note
  // [Images someone still wants] in chunk_scheduler.cpp). One per chunk.
  void expect_image(ChunkId id, std::uint64_t version);
  void forget_expected_image(ChunkId id);

  ChunkSchedulerStats stats() const;
  // Zeroes the counters; peaks restart from what is resident now.
  void reset_stats();

  // The disk tier, or null without one.
  const DiskTier* disk() const { return disk_.get(); }
  // (Mutable for fault injection in tests: DiskTier::fail_nth.)
  DiskTier* disk() { return disk_.get(); }
  // Note [Chunks on NVMe: after a failure] in disk_tier.h: throws a
  // RuntimeError carrying the tier's first failure once a read or write has
  // failed; no-op otherwise (and without a tier). access() calls it first.
  void check_disk() const;
  // Gives every chunk of the lists allowed on disk its home in the file now
  // (Note [Chunks on NVMe: the tier]), so a disk too small fails here, before
  // training, and never in the middle of a step; throws OutOfMemoryError
  // naming the path, the bytes needed, the budget and the bytes free. Call
  // after registration; chunks registered later get their home when they
  // first go to disk. No-op without a disk tier.
  void reserve_disk();
  // Removes the disk tier's file now (after a failed start, whose traceback
  // may keep the scheduler alive): ValueError while a chunk is on disk.
  void close_disk();

  // Checks the store's invariants and the scheduler's own: every payload is
  // one live block of the chunk's size in the chunk's space, resident lists
  // match the store, held bytes = resident + cached, resident <= budget in
  // each space and held <= budget on the host (Note [Blocks leaving over a
  // lowered budget]),
  // the prefetch count matches the flags, the trace bookkeeping is in step.
  // Runs after every operation under TIDAL_DEBUG_FULL.
  void validate() const;

 private:
  static constexpr std::int64_t kNotHeldDown = std::numeric_limits<std::int64_t>::min();
  struct Slot {
    BlockPtr block;          // the payload; null without one
    std::uint32_t resident_pos = 0;  // index in resident_[space]
    bool prefetched = false; // moved by prefetch, not accessed since
    bool staged = false;     // prefetched from disk to the host for a use on the device
    bool ahead = false;      // prefetched by send_ahead: not counted against prefetch_depth
    // The home on disk holds the payload's bytes: set by a read from disk and
    // a write to it, cleared by any write (Note [Chunks on NVMe: clean chunks]).
    bool disk_current = false;
    // Everything that may change the payload's bytes counts here: a host
    // block tagged with an earlier count no longer holds them (Note [A clean
    // chunk goes down without a copy]).
    std::uint64_t writes = 0;
    // expect_image: a take_back_image of this write count will come.
    bool image_expected = false;
    std::uint64_t expected_image_version = 0;
    // The payload's bytes may have changed: neither its home on disk nor a
    // host block it came up from holds them any more.
    void written() {
      disk_current = false;
      ++writes;
    }
    // Copies over the link since the first step ended (Note [Pinned at the
    // second crossing]).
    std::uint32_t crossings = 0;
    // Left ahead of the lowering after this moment (Note [Chunks leave ahead
    // of a lowering]): not brought back before it; kNotHeldDown: none.
    std::int64_t down_until = kNotHeldDown;
  };
  // Whether copies over the link are counted yet (not in the first step).
  bool counts_crossings() const { return steps_ended_ >= 1; }
  // Whether chunk `id`'s next copy over the link is its second counted one
  // or later: its host block is pinned for it.
  bool crosses_again(ChunkId id) const;
  // Who needs room: for messages and for the prefetch rule.
  struct RoomRequest {
    MemorySpace space = MemorySpace::kNone;
    std::size_t bytes = 0;
    ChunkId chunk = kNoChunk;         // the chunk that will take the room
    TensorRef tensor{};               // the accessed tensor, if any
    bool has_tensor = false;
    ChunkId evicting_for = kNoChunk;  // set when making room on the host for an eviction
    bool prefetch = false;            // give up (return false) instead of throwing
    std::int64_t needed_at = 0;       // prefetch: the moment the chunk is needed
  };

  void sync_slots();
  const AccessTrace* live_trace() const { return following_ && !trace_.empty() ? &trace_ : nullptr; }
  void follow(std::int64_t moment, TraceEntry entry);
  // Returns false (prefetch only) when room could not be made.
  bool place(ChunkId id, MemorySpace space, const RoomRequest& request);
  bool make_room(const RoomRequest& request);
  BlockPtr acquire_block(const RoomRequest& request);
  // Whether a chunk of `bytes` may take a cached block of `space`: the
  // resident bytes stay within its budget (Note [Blocks leaving over a
  // lowered budget]).
  bool may_reuse(MemorySpace space, std::size_t bytes) const;
  // pool_.take_cached where may_reuse, else null.
  BlockPtr reuse_block(MemorySpace space, std::size_t bytes, bool pinned = false);
  ChunkId choose_victim(const RoomRequest& request);
  // Whether chunk `id` may go to the disk tier (there is one, and its list is
  // in disk_kinds).
  bool on_disk_list(ChunkId id) const {
    return disk_ && (options_.disk_kinds & (1u << index_of(kind_of(id)))) != 0;
  }
  // The eviction policy's choice among candidates_ for `space`, checked to be
  // one of them; as of the moment `request` is made for.
  ChunkId pick(const RoomRequest& request, MemorySpace space);
  // The host bytes an eviction made for chunk `incoming` may fill (Note
  // [Swaps through the host's last chunk] in chunk_scheduler.cpp).
  std::size_t eviction_host_budget(ChunkId incoming) const;
  // Moves a victim off the device (or drops it when all FREE). False only
  // for a prefetch that could not make room on the host.
  bool evict(ChunkId victim, const RoomRequest& request);
  // Makes host room by moving a host chunk to free device room (Note [One
  // place per chunk]). False when no chunk can go.
  bool spill_to_device(const RoomRequest& request);
  // After a step: host chunks go up into free device room until the host
  // reserve is free again (Note [One place per chunk]).
  void restore_host_reserve();
  // Makes host room by writing a host chunk to the disk tier (Note [Chunks
  // on NVMe: the tier]). False when there is no tier or no chunk can go.
  bool write_to_disk_for(const RoomRequest& request);
  void write_to_disk(ChunkId id);
  // Reads chunk `id` from the disk tier into `block` (a host block).
  void read_from_disk(ChunkId id, BlockPtr block);
  // Whether the pool's image of chunk `chunk` as of write count `version`
  // may still be taken back (Note [Images someone still wants]).
  bool image_wanted(std::int64_t chunk, std::uint64_t version) const;
  // The budget make_room keeps `request` within (before a device prefetch's
  // planned lowering).
  std::size_t budget_for(const RoomRequest& request) const;
  // release() and release_taking_image() (image_version null: the first).
  bool release_with(TensorRef ref, TensorState state, const std::uint64_t* image_version);
  // Frees host blocks cached beyond host_cache_blocks whose copies are done.
  void trim_host_cache() { pool_.trim_ready(MemorySpace::kHost, host_keep_blocks_, host_keep_by_size_); }
  // A chunk left `from` for `to`: the prefetch cursor goes back to its next
  // use if it had passed it (Note [Prefetch]).
  void rewind_prefetch(ChunkId id);
  void move(ChunkId id, MemorySpace to, BlockPtr destination);
  // Note [A clean chunk goes down without a copy]: moves device chunk `id`
  // to the host block it came up from, if the pool still holds it with the
  // chunk's bytes. Whether it did.
  bool come_down_clean(ChunkId id);
  // Chunk `id` takes `image` (a cached host block of its bytes) as its
  // payload; the block it had goes to the pool.
  void swap_to_image(ChunkId id, BlockPtr image);
  // Whether chunk `id` may leave the device that way (options, no disk tier,
  // its pool).
  bool may_skip_copies(ChunkId id) const;
  void drop_payload(ChunkId id);
  void attach(ChunkId id, BlockPtr block);
  BlockPtr detach(ChunkId id);
  void clear_prefetched(ChunkId id, bool wasted);
  void prefetch();
  // Places chunk `id` in `space` for its use at moment `needed_at` under the
  // prefetch's room rule (Note [Prefetch]) and flags and counts the move (a
  // send_ahead's when `ahead`); false, with nothing changed, without room.
  bool start_prefetch(ChunkId id, MemorySpace space, std::int64_t needed_at, bool ahead);
  // prefetch(), except that a failure of the disk tier met on the way stops
  // it without an exception: the call that prefetches (an access, a release,
  // end_step) has done its own work, and the next access raises the failure
  // (Note [Chunks on NVMe: after a failure] in disk_tier.h).
  void prefetch_unless_disk_failed();
  void clear_all_prefetched();
  [[noreturn]] void throw_no_room(const RoomRequest& request, const char* why) const;
  // The device budget, or the ceiling when lower.
  std::size_t device_budget_now() const;
  // The lowest budget the plan sets before the access at `needed_at`
  // (Note [Chunks leave ahead of a lowering]); the largest size_t without one.
  std::size_t planned_budget_before(std::int64_t needed_at) const;
  // Plays the rest of the step with the planned lowerings (Note [Chunks
  // leave ahead of a lowering]): their victims that no access uses before
  // them go to leave_now_, the others to leave_after_use_ with the moment of
  // their latest access before their lowering.
  void play_lowerings();
  struct PlannedLeave {
    ChunkId chunk = kNoChunk;
    std::int64_t after = 0;  // the chunk leaves after the access at this moment
    std::int64_t until = 0;  // for the lowering after the access at this moment
  };
  // Moves the chunk off the device ahead of its lowering, as an eviction;
  // false, with nothing moved, where the host has no room for it.
  bool leave_ahead(const PlannedLeave& leave);
  // Whether chunk `id` left ahead of a lowering still to come.
  bool held_down(ChunkId id) const;
  // Drops the plan (a step's end, a departure from the trace).
  void clear_plan();
  // release(): chunk `id` leaves if the plan has it leave after a use that
  // has come.
  void leave_after_use(ChunkId id);
  void debug_validate() const;

  std::shared_ptr<Device> device_;
  ChunkSchedulerOptions options_;
  std::function<std::size_t()> ceiling_;
  ChunkStore store_;
  std::shared_ptr<EvictionPolicy> policy_;
  std::unique_ptr<Stream> h2d_stream_;
  std::unique_ptr<Stream> d2h_stream_;
  // Before pool_: blocks with disk I/O in flight go before the file.
  std::unique_ptr<DiskTier> disk_;
  BlockPool pool_;
  std::array<std::size_t, kNumMemorySpaces> budget_{};

  std::vector<Slot> slots_;                   // by ChunkId
  std::vector<std::uint64_t> last_use_;       // by ChunkId
  std::array<std::vector<ChunkId>, kNumMemorySpaces> resident_;
  std::vector<ChunkId> candidates_;           // scratch for victim choice
  std::uint64_t tick_ = 0;

  AccessTrace trace_;
  std::vector<TraceEntry> recording_;  // this step's sequence while not following
  bool following_ = false;
  std::int64_t moment_ = -1;
  std::int64_t prefetch_cursor_ = 0;   // next trace moment prefetch looks at
  std::size_t outstanding_prefetches_ = 0;
  std::size_t outstanding_ahead_ = 0;  // those of them sent by send_ahead
  std::vector<ChunkId> ahead_wasted_;  // take_ahead_wasted()
  bool prefetch_blocked_ = false;      // the cursor waits for a chunk to become movable
  // Note [Chunks leave ahead of a lowering]: the plan, the chunks that
  // leave after a use still to come (few: a linear search), and those that
  // left and are held down until their lowering.
  std::vector<PlannedLowering> lowerings_;
  static constexpr std::size_t kPlayedLowerings = 64;  // play_lowerings looks this far
  std::vector<PlannedLeave> leave_after_use_;
  std::vector<ChunkId> held_down_;
  std::vector<PlannedLeave> leave_now_;      // play_lowerings' output
  std::vector<std::int64_t> playing_;        // play_lowerings' scratch
  std::vector<std::uint64_t> played_use_;    // play_lowerings' recency
  // Free host blocks kept (Note [Host blocks for a steady step]).
  std::size_t host_keep_blocks_ = 0;
  // Note [Host blocks for a steady step], by block size: pool_'s host
  // handed_out_by_size when the step began, the previous step's takes, and
  // what the cache keeps of each size.
  std::map<std::size_t, std::uint64_t> step_start_host_blocks_;
  std::map<std::size_t, std::size_t> last_step_host_blocks_;
  std::map<std::size_t, std::size_t> host_keep_by_size_;
  std::size_t steps_ended_ = 0;               // end_step() calls so far
  static constexpr std::size_t kKeepEveryHostBlock = ~std::size_t{0};
  ChunkSchedulerStats pool_base_;  // the pool's counters at the last reset_stats()

  ChunkSchedulerStats stats_;
};

}  // namespace tidal

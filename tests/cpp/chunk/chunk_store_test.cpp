// Registration, oversize tensors and their warning, payload rules, and the
// per-space accounting that validate() checks.
#include "chunk/chunk_store.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/core/error.h"

namespace tidal {
namespace {

TEST(ChunkStore, RegistersTensorsInFirstUseOrder) {
  ChunkStore store({.chunk_bytes = 1024});  // 512 fp16 elements
  EXPECT_EQ(store.chunk_elements(), 512u);
  const TensorId a = store.register_tensor("embed", 300);
  const TensorId b = store.register_tensor("ln", 100);
  const TensorId c = store.register_tensor("proj", 300);
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1u);
  EXPECT_EQ(c, 2u);
  EXPECT_EQ(store.placement(a).chunk, 0u);
  EXPECT_EQ(store.placement(b).chunk, 0u);
  EXPECT_EQ(store.placement(b).offset, 320u);  // 300 rounded up to 32
  EXPECT_EQ(store.placement(c).chunk, 1u);
  EXPECT_EQ(store.num_chunks(), 2u);
  EXPECT_EQ(store.tensor_name(c), "proj");
  EXPECT_EQ(store.tensor_numel(c), 300u);
  EXPECT_EQ(store.find_tensor("ln"), std::optional<TensorId>(b));
  EXPECT_EQ(store.find_tensor("nope"), std::nullopt);
  for (ChunkKind kind : kAllChunkKinds) {
    for (TensorId t : {a, b, c}) EXPECT_EQ(store.state({kind, t}), TensorState::kFree);
  }
  EXPECT_EQ(store.chunks_in(MemorySpace::kNone), 2 * kNumChunkKinds);
  EXPECT_TRUE(store.take_warnings().empty());
  store.validate();
}

TEST(ChunkStore, RejectsBadRegistrations) {
  ChunkStore store({.chunk_bytes = 1024});
  store.register_tensor("w", 10);
  try {
    store.register_tensor("w", 10);
    FAIL() << "duplicate name accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("'w' is already registered"), std::string::npos) << e.message();
  }
  EXPECT_THROW(store.register_tensor("", 10), ValueError);
  EXPECT_THROW(store.register_tensor("empty", 0), ValueError);
  EXPECT_EQ(store.num_tensors(), 1u);
  EXPECT_THROW(store.tensor_name(5), IndexError);
  EXPECT_THROW(store.state({ChunkKind::kParam16, 5}), IndexError);
  store.validate();
}

TEST(ChunkStore, RejectsBadOptions) {
  EXPECT_THROW(ChunkStore({.chunk_bytes = 1023}), ValueError);  // odd bytes of fp16
  EXPECT_THROW(ChunkStore({.chunk_bytes = 1000}), ValueError);  // 500 elements, not /32
  // float32 (the exactness mode) needs chunk_bytes in whole 4-byte elements.
  EXPECT_THROW(ChunkStore({.chunk_bytes = 1026, .param_dtype = DType::kFloat32}), ValueError);
  ChunkStore fp32({.chunk_bytes = 1024, .param_dtype = DType::kFloat32});
  EXPECT_EQ(fp32.chunk_elements(), 256u);
  EXPECT_NO_THROW(ChunkStore({.chunk_bytes = 1024, .param_dtype = DType::kBFloat16}));
  EXPECT_EQ(ChunkStore().chunk_elements(), kDefaultChunkBytes / 2);
  EXPECT_EQ(kDefaultChunkBytes, std::size_t{64} << 20);
}

TEST(ChunkStore, OversizeTensorGetsADedicatedChunkAndAWarningNamingIt) {
  ChunkStore store({.chunk_bytes = 1024});
  store.register_tensor("small", 10);
  const TensorId big = store.register_tensor("lm_head.weight", 1000);
  const TensorId next = store.register_tensor("after", 10);
  const Chunk& chunk = store.chunk(store.chunk_of({ChunkKind::kParam16, big}));
  EXPECT_TRUE(chunk.dedicated());
  EXPECT_EQ(chunk.num_tensors(), 1u);
  EXPECT_EQ(chunk.capacity_elements(), 1024u);  // 1000 rounded up to the alignment
  EXPECT_EQ(chunk.capacity_bytes(), 2048u);
  EXPECT_EQ(store.chunk(store.chunk_of({ChunkKind::kParam32, big})).capacity_bytes(), 4096u);
  EXPECT_EQ(store.placement(next).chunk, 0u);  // the open chunk's tail, beside "small"
  const std::vector<std::string> warnings = store.take_warnings();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("'lm_head.weight'"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("1000 elements"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("dedicated chunk"), std::string::npos) << warnings[0];
  EXPECT_TRUE(store.take_warnings().empty()) << "take_warnings() clears";
  store.validate();
}

TEST(ChunkStore, WarningHandlerReceivesWarningsInsteadOfTheQueue) {
  ChunkStore store({.chunk_bytes = 1024});
  std::vector<std::string> seen;
  store.set_warning_handler([&](const std::string& message) { seen.push_back(message); });
  store.register_tensor("huge", 5000);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_NE(seen[0].find("'huge'"), std::string::npos);
  EXPECT_TRUE(store.take_warnings().empty());
}

TEST(ChunkStore, PayloadRulesAndPerSpaceAccounting) {
  ChunkStore store({.chunk_bytes = 1024});
  const TensorId a = store.register_tensor("a", 100);
  const TensorId b = store.register_tensor("b", 100);
  const TensorRef ra{ChunkKind::kParam16, a};
  const TensorRef rb{ChunkKind::kParam16, b};
  const ChunkId id = store.chunk_of(ra);
  ASSERT_EQ(id, store.chunk_of(rb));
  std::vector<unsigned char> host(1024), device(1024);

  // A FREE slot cannot start holding data without a payload.
  EXPECT_THROW(store.set_state(ra, TensorState::kCompute), ValueError);
  EXPECT_EQ(store.tensor_data(ra), nullptr);

  store.set_payload(id, host.data(), MemorySpace::kHost);
  EXPECT_EQ(store.bytes_in(MemorySpace::kHost), 1024u);
  EXPECT_EQ(store.chunks_in(MemorySpace::kHost), 1u);
  EXPECT_EQ(store.tensor_data(rb), host.data() + 128 * 2);
  store.set_state(ra, TensorState::kCompute);

  // NB: a chunk is movable only when no tensor in it is COMPUTE.
  try {
    store.set_payload(id, device.data(), MemorySpace::kDevice);
    FAIL() << "moved a chunk with a COMPUTE tensor";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("'a'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("COMPUTE"), std::string::npos) << e.message();
  }
  EXPECT_EQ(store.chunk(id).payload(), host.data());
  store.set_state(ra, TensorState::kHoldAfterFwd);
  store.set_payload(id, device.data(), MemorySpace::kDevice);
  EXPECT_EQ(store.bytes_in(MemorySpace::kHost), 0u);
  EXPECT_EQ(store.bytes_in(MemorySpace::kDevice), 1024u);

  // Only an all-FREE chunk drops its payload.
  EXPECT_THROW(store.set_payload(id, nullptr, MemorySpace::kNone), ValueError);
  store.set_state(ra, TensorState::kFree);
  EXPECT_TRUE(store.chunk(id).all_free());
  store.set_payload(id, nullptr, MemorySpace::kNone);
  EXPECT_EQ(store.bytes_in(MemorySpace::kDevice), 0u);
  EXPECT_FALSE(store.chunk(id).has_payload());

  // A payload goes with a space, and null with kNone.
  EXPECT_THROW(store.set_payload(id, host.data(), MemorySpace::kNone), ValueError);
  EXPECT_THROW(store.set_payload(id, nullptr, MemorySpace::kHost), ValueError);
  store.validate();
}

TEST(ChunkStore, DescribesChunksForMessages) {
  ChunkStore store({.chunk_bytes = 1024});
  store.register_tensor("h.0.w", 100);
  store.register_tensor("h.0.b", 100);
  const std::string text = store.describe_chunk(make_chunk_id(ChunkKind::kParam32, 0));
  EXPECT_NE(text.find("param32 #0"), std::string::npos) << text;
  EXPECT_NE(text.find("'h.0.w' .. 'h.0.b' (2)"), std::string::npos) << text;
  EXPECT_NE(text.find("2.00 KiB"), std::string::npos) << text;
  EXPECT_NE(text.find("no payload"), std::string::npos) << text;
}

}  // namespace
}  // namespace tidal

// The four chunk lists share one layout (Note [One layout, five lists]).
#include "chunk/chunk_list.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <random>
#include <string>
#include <vector>

#include "chunk/chunk_store.h"

namespace tidal {
namespace {

// "t" + std::to_string(i) makes GCC 12 at -O3 warn falsely (-Wrestrict,
// GCC bug 105329); appending to a named string does not.
inline std::string indexed_name(const char* prefix, std::size_t i) {
  std::string name(prefix);
  name.append(std::to_string(i));
  return name;
}

TEST(ChunkList, LayoutIsIdenticalAcrossTheFourLists) {
  for (DType param : {DType::kFloat16, DType::kBFloat16}) {
    ChunkStore store({.chunk_bytes = 8192, .param_dtype = param});
    std::mt19937 rng(7);
    const std::size_t chunk_elements = store.chunk_elements();
    ASSERT_EQ(chunk_elements, 4096u);
    for (int i = 0; i < 60; ++i) {
      std::size_t numel = 1 + rng() % 1500;
      if (i % 17 == 5) numel = chunk_elements + 1 + rng() % 3000;  // oversize
      store.register_tensor(indexed_name("t", i), numel);
    }
    store.validate();
    const ChunkList& p16 = store.list(ChunkKind::kParam16);
    EXPECT_EQ(p16.dtype(), param);
    for (ChunkKind kind : kAllChunkKinds) {
      const ChunkList& list = store.list(kind);
      EXPECT_EQ(list.kind(), kind);
      ASSERT_EQ(list.size(), p16.size()) << to_string(kind);
      if (kind != ChunkKind::kParam16) {
        EXPECT_EQ(list.dtype(), DType::kFloat32);
      }
      for (ChunkIndex c = 0; c < list.size(); ++c) {
        EXPECT_EQ(list[c].capacity_elements(), p16[c].capacity_elements());
        EXPECT_EQ(list[c].num_tensors(), p16[c].num_tensors());
        EXPECT_EQ(list[c].dedicated(), p16[c].dedicated());
        EXPECT_EQ(list[c].capacity_bytes(),
                  list[c].capacity_elements() * element_size(list.dtype()));
        EXPECT_EQ(list[c].id(), make_chunk_id(kind, c));
      }
      EXPECT_EQ(list.capacity_bytes(),
                p16.capacity_bytes() / element_size(param) * element_size(list.dtype()));
    }
    // Tensor i sits at the same chunk index and element offset in every list:
    // with payloads in place, its byte offset scales with the element size.
    std::vector<std::vector<unsigned char>> payloads;
    for (ChunkKind kind : kAllChunkKinds) {
      for (const Chunk& chunk : store.list(kind)) {
        payloads.emplace_back(chunk.capacity_bytes());
        store.set_payload(chunk.id(), payloads.back().data(), MemorySpace::kHost);
      }
    }
    for (TensorId t = 0; t < store.num_tensors(); ++t) {
      const TensorPlacement& at = store.placement(t);
      for (ChunkKind kind : kAllChunkKinds) {
        const TensorRef ref{kind, t};
        const Chunk& chunk = store.chunk(store.chunk_of(ref));
        EXPECT_EQ(chunk.index(), at.chunk);
        EXPECT_EQ(static_cast<char*>(store.tensor_data(ref)) - static_cast<char*>(chunk.payload()),
                  static_cast<std::ptrdiff_t>(at.offset * element_size(chunk.dtype())));
        EXPECT_EQ(store.tensor_bytes(ref), at.numel * element_size(chunk.dtype()));
        const std::vector<TensorId>& held = store.tensors_of(chunk.index());
        EXPECT_EQ(std::count(held.begin(), held.end(), t), 1);
      }
    }
    store.validate();
  }
}

TEST(ChunkList, ChunkIdsInterleaveTheListsAndStayStableAsTheyGrow) {
  ChunkStore store({.chunk_bytes = 4096});
  store.register_tensor("a", 2048);
  const ChunkId first = store.chunk_of({ChunkKind::kVariance, 0});
  EXPECT_EQ(first, make_chunk_id(ChunkKind::kVariance, 0));
  store.register_tensor("b", 2048);  // a second chunk in every list
  EXPECT_EQ(store.chunk_of({ChunkKind::kVariance, 0}), first);
  EXPECT_EQ(store.chunk_id_limit(), 2 * kNumChunkKinds);
  for (ChunkId id = 0; id < store.chunk_id_limit(); ++id) {
    EXPECT_EQ(store.chunk(id).id(), id);
    EXPECT_EQ(kind_of(id), store.chunk(id).kind());
    EXPECT_EQ(index_of_chunk(id), store.chunk(id).index());
  }
}

}  // namespace
}  // namespace tidal

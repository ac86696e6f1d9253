// Placement: Note [One layout, five lists].
#include "chunk/chunk_layout.h"

#include <gtest/gtest.h>

#include "runtime/core/error.h"

namespace tidal {
namespace {

TEST(ChunkLayout, AppendsInRegistrationOrderAtAlignedOffsets) {
  ChunkLayout layout(/*chunk_elements=*/128, /*alignment_elements=*/32);
  const TensorPlacement a = layout.append(10);   // [0, 10)
  const TensorPlacement b = layout.append(33);   // [32, 65)
  const TensorPlacement c = layout.append(40);   // [96, 136) does not fit: new chunk
  const TensorPlacement d = layout.append(64);   // [64, 128) after c's [0, 40)
  EXPECT_EQ(a.chunk, 0u);
  EXPECT_EQ(a.offset, 0u);
  EXPECT_EQ(b.chunk, 0u);
  EXPECT_EQ(b.offset, 32u);
  EXPECT_EQ(c.chunk, 1u);
  EXPECT_EQ(c.offset, 0u);
  EXPECT_EQ(d.chunk, 1u);
  EXPECT_EQ(d.offset, 64u);
  EXPECT_EQ(layout.num_chunks(), 2u);
  EXPECT_EQ(layout.extent(0).tensors, (std::vector<TensorId>{0, 1}));
  EXPECT_EQ(layout.extent(0).num_tensors, 2u);
  EXPECT_EQ(layout.extent(0).used, 65u);
  EXPECT_EQ(layout.extent(1).tensors, (std::vector<TensorId>{2, 3}));
  EXPECT_EQ(layout.extent(1).num_tensors, 2u);
  EXPECT_EQ(layout.extent(1).used, 128u);
  EXPECT_EQ(layout.total_numel(), 10u + 33 + 40 + 64);
  EXPECT_EQ(layout.total_capacity(), 256u);
  EXPECT_EQ(layout.waste_elements(), 256u - 147);
}

TEST(ChunkLayout, ExactFitFillsAChunk) {
  ChunkLayout layout(64, 32);
  layout.append(32);
  const TensorPlacement b = layout.append(32);
  EXPECT_EQ(b.chunk, 0u);
  EXPECT_EQ(b.offset, 32u);
  EXPECT_EQ(layout.append(1).chunk, 1u);
  EXPECT_EQ(layout.waste_elements(), 63u);
}

TEST(ChunkLayout, OversizeTensorGetsADedicatedChunkAndTheOpenOneStaysOpen) {
  ChunkLayout layout(64, 32);
  layout.append(8);                                // chunk 0, room left
  const TensorPlacement big = layout.append(100);  // dedicated chunk 1 of 128
  const TensorPlacement after = layout.append(8);  // chunk 0's tail, not a new chunk
  EXPECT_EQ(big.chunk, 1u);
  EXPECT_EQ(big.offset, 0u);
  EXPECT_TRUE(layout.extent(1).dedicated);
  EXPECT_EQ(layout.extent(1).capacity, 128u);
  EXPECT_EQ(layout.extent(1).num_tensors, 1u);
  EXPECT_EQ(after.chunk, 0u);
  EXPECT_EQ(after.offset, 32u);
  EXPECT_EQ(layout.dedicated_chunks(), 1u);
  // Nothing joins a dedicated chunk, even "with the previous" (its bias).
  const TensorPlacement big2 = layout.append(100);
  EXPECT_NE(layout.append(8, 0, /*with_previous=*/true).chunk, big2.chunk);
  EXPECT_EQ(layout.extent(big2.chunk).num_tensors, 1u);
  // A tensor of exactly the chunk size is not oversize.
  EXPECT_FALSE(layout.extent(layout.append(64).chunk).dedicated);
}

TEST(ChunkLayout, AModelWithDedicatedWeightsPacksItsSmallTensorsTogether) {
  // A GPT block whose qkv and MLP weights are larger than a chunk: between them
  // only half a chunk of projection and a few small tensors per block. With the
  // open chunks kept across dedicated chunks, four blocks' small tensors need
  // three regular chunks; when each dedicated chunk closed them, eight.
  ChunkLayout layout(64, 4);
  for (int block = 0; block < 4; ++block) {
    layout.append(4);    // ln1
    layout.append(192);  // qkv (dedicated)
    layout.append(32);   // proj: half a chunk
    layout.append(4);    // ln2
    layout.append(256);  // fc (dedicated)
    layout.append(256);  // out (dedicated)
  }
  EXPECT_EQ(layout.dedicated_chunks(), 12u);
  EXPECT_EQ(layout.num_chunks() - layout.dedicated_chunks(), 3u);
  EXPECT_LE(layout.waste_elements(), 64u + 16u);
}

TEST(ChunkLayout, SmallTensorsGoToTheFullestOpenChunkSoHalfChunkWeightsPair) {
  // gpt-1.3b's MLP at 64 MiB chunks: weights of exactly half a chunk, each
  // with a bias. Beside its weight a bias leaves less than half a chunk, and
  // every weight opened a chunk of its own (8 chunks, half of them padding).
  // Now the weights pair from the second block on (the first block's biases
  // fill the first chunk's tail).
  ChunkLayout layout(4096, 4);
  for (int block = 0; block < 4; ++block) {
    layout.append(2048);                          // fc.weight
    layout.append(4, 0, /*with_previous=*/true);  // fc.bias: small
    layout.append(2048);                          // out.weight
    layout.append(4, 0, /*with_previous=*/true);  // out.bias
  }
  EXPECT_EQ(layout.num_chunks(), 6u);
  // A bias still sits in one of the two chunks opened last.
  for (TensorId t = 1; t < layout.num_tensors(); t += 2) {
    EXPECT_GE(layout.placement(t).chunk + 1, layout.placement(t - 1).chunk) << "tensor " << t;
  }
  // Not small (more than 1/1024 of a chunk): beside its weight, as before.
  ChunkLayout big(4096, 4);
  big.append(3000);
  big.append(2000);                             // opens chunk 1, less full than chunk 0
  const TensorPlacement bias = big.append(8, 0, /*with_previous=*/true);
  EXPECT_EQ(bias.chunk, 1u);
  // A small one goes to the fullest: chunk 0.
  EXPECT_EQ(big.append(4, 0, /*with_previous=*/true).chunk, 0u);
}

TEST(ChunkLayout, TheTensorsAfterALargeOneFillThePreviousChunksTail) {
  ChunkLayout layout(64, 4);
  EXPECT_EQ(layout.append(40).chunk, 0u);
  EXPECT_EQ(layout.append(40).chunk, 1u);  // no room in chunk 0's tail of 24
  const TensorPlacement small = layout.append(20);
  EXPECT_EQ(small.chunk, 0u);              // the oldest open chunk first
  EXPECT_EQ(small.offset, 40u);
  EXPECT_EQ(layout.append(30).chunk, 2u);  // fits neither: chunk 0 closes
  const TensorPlacement tail = layout.append(4);
  EXPECT_EQ(tail.chunk, 1u);               // chunk 1's tail, not chunk 0's
  EXPECT_EQ(tail.offset, 40u);
  EXPECT_EQ(layout.waste_elements(), 3 * 64u - (40 + 40 + 20 + 30 + 4));
}

TEST(ChunkLayout, AModulesNextTensorStaysWithThePreviousOne) {
  ChunkLayout layout(64, 4);
  EXPECT_EQ(layout.append(40).chunk, 0u);
  EXPECT_EQ(layout.append(40).chunk, 1u);  // a weight that opens chunk 1
  const TensorPlacement bias = layout.append(4, 0, /*with_previous=*/true);
  EXPECT_EQ(bias.chunk, 1u);               // beside its weight, not in chunk 0's tail
  EXPECT_EQ(bias.offset, 40u);
  EXPECT_EQ(layout.append(20).chunk, 0u);  // the next module fills chunk 0's tail
  // With the previous tensor's chunk full, the oldest open chunk with room.
  EXPECT_EQ(layout.append(16, 0, true).chunk, 1u);
  EXPECT_EQ(layout.append(8, 0, true).chunk, 2u);
}

TEST(ChunkLayout, PoolsNeverShareAChunk) {
  // Note [Pools keep frozen tensors apart]: frozen (pool 1) and trainable
  // (pool 0) tensors interleaved, as LoRA adapters between base weights.
  ChunkLayout layout(64, 8);
  const TensorPlacement base0 = layout.append(30, 1);
  const TensorPlacement lora0 = layout.append(4, 0);
  const TensorPlacement base1 = layout.append(30, 1);
  const TensorPlacement lora1 = layout.append(4, 0);
  const TensorPlacement base2 = layout.append(30, 1);  // pool 1's chunk is full: a new one
  EXPECT_EQ(base0.chunk, 0u);
  EXPECT_EQ(lora0.chunk, 1u);
  EXPECT_EQ(base1.chunk, 0u);
  EXPECT_EQ(base1.offset, 32u);
  EXPECT_EQ(lora1.chunk, 1u);
  EXPECT_EQ(lora1.offset, 8u);
  EXPECT_EQ(base2.chunk, 2u);
  EXPECT_EQ(layout.extent(0).pool, 1u);
  EXPECT_EQ(layout.extent(1).pool, 0u);
  EXPECT_EQ(layout.extent(2).pool, 1u);
  EXPECT_EQ(layout.extent(0).tensors, (std::vector<TensorId>{0, 2}));
  EXPECT_EQ(layout.extent(1).tensors, (std::vector<TensorId>{1, 3}));
  // A dedicated chunk belongs to its pool; both pools go on in their open chunks.
  const TensorPlacement big = layout.append(100, 0);
  EXPECT_TRUE(layout.extent(big.chunk).dedicated);
  EXPECT_EQ(layout.extent(big.chunk).pool, 0u);
  EXPECT_EQ(layout.append(4, 1).chunk, 2u);   // pool 1 goes on in its chunk
  EXPECT_EQ(layout.append(4, 0).chunk, 1u);   // pool 0 too: chunk 1's tail
}

TEST(ChunkLayout, RejectsBadSizes) {
  EXPECT_THROW(ChunkLayout(100, 32), ValueError);  // not a multiple of the alignment
  EXPECT_THROW(ChunkLayout(96, 24), ValueError);   // alignment not a power of two
  EXPECT_THROW(ChunkLayout(0, 32), ValueError);
  ChunkLayout layout(64, 32);
  EXPECT_THROW(layout.append(0), ValueError);
  EXPECT_EQ(layout.num_tensors(), 0u);
}

}  // namespace
}  // namespace tidal

// The advisor's choice on sizes whose answer is known by hand, and its
// agreement with the store's own layout.
#include "chunk/chunk_size_advisor.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "chunk/chunk_store.h"
#include "runtime/core/error.h"

namespace tidal {
namespace {

// "t" + std::to_string(i) makes GCC 12 at -O3 warn falsely (-Wrestrict,
// GCC bug 105329); appending to a named string does not.
inline std::string indexed_name(const char* prefix, std::size_t i) {
  std::string name(prefix);
  name.append(std::to_string(i));
  return name;
}

TEST(ChunkSizeAdvisor, FindsTheSizeWithNoWaste) {
  // Six tensors of 5: a chunk of 10 holds two each with nothing left over;
  // 7..9 hold one (waste 2..4 each), 11 wastes 1 per chunk, 12 wastes 2.
  const std::vector<std::size_t> sizes(6, 5);
  const ChunkSizeAdvice advice = advise_chunk_size(
      sizes, {.min_elements = 7, .max_elements = 12, .step_elements = 1, .alignment_elements = 1});
  EXPECT_EQ(advice.chunk_elements, 10u);
  EXPECT_EQ(advice.num_chunks, 3u);
  EXPECT_EQ(advice.waste_elements, 0u);
  EXPECT_EQ(advice.waste_fraction, 0.0);
  EXPECT_EQ(advice.total_elements, 30u);
  EXPECT_EQ(advice.candidates, 6u);
  EXPECT_EQ(advice.dedicated_chunks, 0u);
}

TEST(ChunkSizeAdvisor, TiesGoToTheLargerChunk) {
  const std::vector<std::size_t> sizes = {4, 4};
  const ChunkSizeAdvice advice = advise_chunk_size(
      sizes, {.min_elements = 4, .max_elements = 8, .step_elements = 1, .alignment_elements = 1});
  EXPECT_EQ(advice.chunk_elements, 8u);  // 4 wastes nothing either, in two chunks
  EXPECT_EQ(advice.num_chunks, 1u);
  EXPECT_EQ(advice.waste_elements, 0u);
}

TEST(ChunkSizeAdvisor, PrefersSizesWithoutDedicatedChunks) {
  const std::vector<std::size_t> sizes = {100, 10};
  // 10 wastes nothing too, but gives the 100 a dedicated chunk; 110 holds both.
  ChunkSizeAdvice advice = advise_chunk_size(
      sizes, {.min_elements = 10, .max_elements = 120, .step_elements = 10, .alignment_elements = 1});
  EXPECT_EQ(advice.chunk_elements, 110u);
  EXPECT_EQ(advice.dedicated_chunks, 0u);
  EXPECT_EQ(advice.waste_elements, 0u);
  // No candidate holds the 100: the least waste among all, dedicated or not.
  advice = advise_chunk_size(
      sizes, {.min_elements = 10, .max_elements = 30, .step_elements = 10, .alignment_elements = 1});
  EXPECT_EQ(advice.chunk_elements, 10u);
  EXPECT_EQ(advice.dedicated_chunks, 1u);
  EXPECT_EQ(advice.num_chunks, 2u);
  EXPECT_EQ(advice.waste_elements, 0u);
}

TEST(ChunkSizeAdvisor, CountsAlignmentPaddingAsWaste) {
  const std::vector<std::size_t> sizes = {33, 31};
  // 64: the 31 would start at 64 and does not fit; two chunks, 128 - 64 wasted.
  ChunkSizeAdvice advice = advise_chunk_size(
      sizes, {.min_elements = 64, .max_elements = 64, .step_elements = 32, .alignment_elements = 32});
  EXPECT_EQ(advice.num_chunks, 2u);
  EXPECT_EQ(advice.waste_elements, 64u);
  // 96: [0, 33) and [64, 95), waste 96 - 64 = 32.
  advice = advise_chunk_size(
      sizes, {.min_elements = 64, .max_elements = 96, .step_elements = 32, .alignment_elements = 32});
  EXPECT_EQ(advice.chunk_elements, 96u);
  EXPECT_EQ(advice.num_chunks, 1u);
  EXPECT_EQ(advice.waste_elements, 32u);
  EXPECT_DOUBLE_EQ(advice.waste_fraction, 32.0 / 96.0);
  // Bytes over the four lists: 2 (fp16) + 3 * 4 (fp32) per element.
  EXPECT_EQ(advice.waste_bytes(DType::kFloat16), 32u * 14);
  EXPECT_EQ(advice.chunk_bytes(DType::kBFloat16), 192u);
}

TEST(ChunkSizeAdvisor, AgreesWithTheStoreAndBeatsEveryOtherCandidate) {
  std::mt19937 rng(11);
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 200; ++i) sizes.push_back(1 + rng() % 20000);
  const ChunkSizeSearch search{.min_elements = 16384, .max_elements = 65536,
                               .step_elements = 1024, .alignment_elements = 32};
  const ChunkSizeAdvice advice = advise_chunk_size(sizes, search);
  ChunkStore store({.chunk_bytes = advice.chunk_bytes(DType::kFloat16)});
  for (std::size_t i = 0; i < sizes.size(); ++i) store.register_tensor(indexed_name("t", i), sizes[i]);
  EXPECT_EQ(store.layout().waste_elements(), advice.waste_elements);
  EXPECT_EQ(store.num_chunks(), advice.num_chunks);
  for (std::size_t size = search.min_elements; size <= search.max_elements; size += search.step_elements) {
    ChunkLayout layout(size, 32);
    for (std::size_t n : sizes) layout.append(n);
    if (layout.dedicated_chunks() == 0) {
      EXPECT_GE(layout.waste_elements(), advice.waste_elements) << size;
    }
  }
}

TEST(ChunkSizeAdvisor, RejectsBadInput) {
  const std::vector<std::size_t> sizes = {4};
  const std::vector<std::size_t> none;
  const std::vector<std::size_t> zero = {4, 0};
  EXPECT_THROW(advise_chunk_size(none, {.min_elements = 4, .max_elements = 8, .step_elements = 1}),
               ValueError);
  EXPECT_THROW(advise_chunk_size(zero, {.min_elements = 32, .max_elements = 64, .step_elements = 32}),
               ValueError);
  EXPECT_THROW(advise_chunk_size(sizes, {.min_elements = 64, .max_elements = 32, .step_elements = 32}),
               ValueError);
  EXPECT_THROW(advise_chunk_size(sizes, {.min_elements = 32, .max_elements = 64, .step_elements = 0}),
               ValueError);
  // Every candidate is below one alignment unit.
  EXPECT_THROW(advise_chunk_size(sizes, {.min_elements = 1, .max_elements = 31, .step_elements = 1}),
               ValueError);
}

}  // namespace
}  // namespace tidal

// Next use in a trace that repeats every step.
#include "runtime/scheduler/access_trace.h"

#include <gtest/gtest.h>

namespace tidal {
namespace {

constexpr MemorySpace kDev = MemorySpace::kDevice;

TEST(AccessTrace, NextUseWrapsIntoTheNextStep) {
  // moments:            0          1          2          3
  const AccessTrace trace({{4, kDev}, {8, kDev}, {4, kDev}, {12, MemorySpace::kHost}});
  trace.validate();
  EXPECT_EQ(trace.size(), 4u);
  EXPECT_EQ(trace.next_use(4, -1), 0);
  EXPECT_EQ(trace.next_use(4, 0), 2);
  EXPECT_EQ(trace.next_use(4, 1), 2);
  EXPECT_EQ(trace.next_use(4, 2), 4);   // moment 0 of the next step
  EXPECT_EQ(trace.next_use(8, 1), 5);
  EXPECT_EQ(trace.next_use(12, 3), 7);
  EXPECT_EQ(trace.next_use(12, 2), 3);
  // Moments beyond the first step keep counting.
  EXPECT_EQ(trace.next_use(8, 5), 9);
  EXPECT_EQ(trace.next_use(4, 6), 8);
  EXPECT_EQ(trace.uses(4), 2u);
  EXPECT_EQ(trace.at(6), (TraceEntry{4, kDev}));
}

TEST(AccessTrace, ChunksOutsideTheTraceAreNeverUsed) {
  const AccessTrace trace({{1, kDev}});
  EXPECT_EQ(trace.next_use(0, 0), AccessTrace::kNever);
  EXPECT_EQ(trace.next_use(99, -1), AccessTrace::kNever);
  EXPECT_EQ(trace.uses(99), 0u);
  EXPECT_EQ(trace.next_use(1, 0), 1);
  EXPECT_EQ(AccessTrace().next_use(1, 0), AccessTrace::kNever);
}

}  // namespace
}  // namespace tidal

// A fresh folder under the test's temporary directory, removed with all it
// holds when the object goes: for the tests of files on disk (DirectFile,
// the scheduler's disk tier).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace tidal::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "tidal_test_") {
    std::string pattern = ::testing::TempDir() + prefix + "XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    const char* made = ::mkdtemp(buf.data());
    EXPECT_NE(made, nullptr);
    path_ = made != nullptr ? made : "";
  }
  ~TempDir() {
    const std::string cmd = "rm -rf '" + path_ + "'";
    EXPECT_EQ(std::system(cmd.c_str()), 0);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tidal::testing

// A vector of tensor or op ids that keeps its first N in the object.
//
// Every recorded op gets an OpRecord (its inputs, its outputs) and every
// result a TensorRecord (its recipe, its users); nearly all of those lists
// hold one to three ids. As std::vectors they cost four heap allocations
// per op and four frees when the results die, which on a small op is more
// than the rest of the record's bookkeeping (benchmarks/dtr.py, per-op
// overhead). This keeps them inline; a longer list moves to the heap.
// Only what the records use is here: ids are plain integers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>

namespace tidal::dtr {

template <std::size_t N>
class SmallIds {
  static_assert(N >= 1, "SmallIds needs room for one id");

 public:
  using value_type = std::int64_t;
  using iterator = std::int64_t*;
  using const_iterator = const std::int64_t*;

  SmallIds() = default;
  SmallIds(const SmallIds& other) { assign(other.begin(), other.end()); }
  SmallIds(SmallIds&& other) noexcept { take(other); }
  SmallIds& operator=(const SmallIds& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  SmallIds& operator=(SmallIds&& other) noexcept {
    if (this != &other) {
      free_heap();
      take(other);
    }
    return *this;
  }
  ~SmallIds() { free_heap(); }

  template <typename It>
  void assign(It first, It last) {
    size_ = 0;
    reserve(static_cast<std::size_t>(std::distance(first, last)));
    for (; first != last; ++first) data()[size_++] = *first;
  }
  void push_back(std::int64_t id) {
    if (size_ == capacity_) reserve(2 * capacity_);
    data()[size_++] = id;
  }
  void clear() { size_ = 0; }
  // Removes [first, last), as std::vector::erase.
  iterator erase(iterator first, iterator last) {
    std::copy(last, end(), first);
    size_ -= static_cast<std::uint32_t>(last - first);
    return first;
  }

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  iterator begin() { return data(); }
  iterator end() { return data() + size_; }
  const_iterator begin() const { return data(); }
  const_iterator end() const { return data() + size_; }
  std::int64_t& operator[](std::size_t i) { return data()[i]; }
  std::int64_t operator[](std::size_t i) const { return data()[i]; }
  std::int64_t front() const { return data()[0]; }
  std::int64_t back() const { return data()[size_ - 1]; }

  void reserve(std::size_t n) {
    if (n <= capacity_) return;
    auto* grown = new std::int64_t[n];
    std::copy(begin(), end(), grown);
    free_heap();
    heap_ = grown;
    capacity_ = static_cast<std::uint32_t>(n);
  }

 private:
  bool on_heap() const { return capacity_ > N; }
  std::int64_t* data() { return on_heap() ? heap_ : inline_; }
  const std::int64_t* data() const { return on_heap() ? heap_ : inline_; }
  void free_heap() {
    if (on_heap()) delete[] heap_;
    capacity_ = N;
  }
  // Takes other's ids (and its heap block), leaving it empty and inline.
  void take(SmallIds& other) {
    size_ = other.size_;
    if (other.on_heap()) {
      heap_ = other.heap_;
      capacity_ = other.capacity_;
      other.capacity_ = N;
    } else {
      std::copy(other.inline_, other.inline_ + other.size_, inline_);
      capacity_ = N;
    }
    other.size_ = 0;
  }

  union {
    std::int64_t inline_[N];
    std::int64_t* heap_;
  };
  std::uint32_t size_ = 0;
  std::uint32_t capacity_ = N;
};

}  // namespace tidal::dtr

// tidal's one error channel. See Note [Two tiers of checks].
//
// Note [Two tiers of checks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TIDAL_CHECK*(cond, args...) reports a *user* error: a bad argument, an
// impossible budget, an unsupported dtype. The message is built from args
// only when cond fails, so checks are cheap on the success path. Each error
// type maps to one Python exception (python/csrc/errors.cpp):
//   ValueError          -> ValueError            (TIDAL_CHECK)
//   TypeError           -> TypeError             (TIDAL_CHECK_TYPE)
//   IndexError          -> IndexError            (TIDAL_CHECK_INDEX)
//   NotImplementedError -> NotImplementedError   (TIDAL_CHECK_SUPPORTED)
//   OutOfMemoryError    -> tidal.OutOfMemoryError (a RuntimeError)
//   Error (base)        -> RuntimeError          (TIDAL_CHECK_RUNTIME)
// TIDAL_INTERNAL_ASSERT(cond, args...) reports *our* bug: an invariant that
// no input may break. It throws InternalError (RuntimeError in Python) whose
// message asks for a report. TIDAL_INTERNAL_ASSERT_DEBUG_ONLY is for hot
// paths: it compiles to nothing unless TIDAL_DEBUG_FULL is on or NDEBUG is
// off, but its condition is still type-checked.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace tidal {

// Base of every error tidal throws. what() holds the user-facing message
// followed by the source location in brackets.
class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line);

  // The message without the location suffix.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

class ValueError : public Error {
  using Error::Error;
};
class TypeError : public Error {
  using Error::Error;
};
class IndexError : public Error {
  using Error::Error;
};
class NotImplementedError : public Error {
  using Error::Error;
};
// A memory space (device memory, the host budget) cannot satisfy a request.
class OutOfMemoryError : public Error {
  using Error::Error;
};
// A broken invariant inside tidal: always a bug of ours.
class InternalError : public Error {
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string str_cat(const Args&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return std::string();
  } else {
    std::ostringstream out;
    (out << ... << args);
    return out.str();
  }
}

[[noreturn]] void throw_internal(const char* condition, const char* file, int line,
                                 const std::string& detail);

template <typename E>
[[noreturn]] void throw_error(const char* file, int line, std::string message) {
  throw E(std::move(message), file, line);
}

}  // namespace detail

// Formats a byte count for humans: "64.00 MiB (67108864 bytes)".
std::string format_bytes(std::size_t bytes);

}  // namespace tidal

#define TIDAL_LIKELY(x) __builtin_expect(!!(x), 1)
#define TIDAL_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define TIDAL_CHECK_WITH(ErrorType, cond, ...)                                       \
  do {                                                                               \
    if (TIDAL_UNLIKELY(!(cond))) {                                                   \
      ::tidal::detail::throw_error<ErrorType>(__FILE__, __LINE__,                     \
                                              ::tidal::detail::str_cat(__VA_ARGS__)); \
    }                                                                                \
  } while (false)

#define TIDAL_CHECK(cond, ...) TIDAL_CHECK_WITH(::tidal::ValueError, cond, __VA_ARGS__)
#define TIDAL_CHECK_TYPE(cond, ...) TIDAL_CHECK_WITH(::tidal::TypeError, cond, __VA_ARGS__)
#define TIDAL_CHECK_INDEX(cond, ...) TIDAL_CHECK_WITH(::tidal::IndexError, cond, __VA_ARGS__)
#define TIDAL_CHECK_SUPPORTED(cond, ...) \
  TIDAL_CHECK_WITH(::tidal::NotImplementedError, cond, __VA_ARGS__)
#define TIDAL_CHECK_RUNTIME(cond, ...) TIDAL_CHECK_WITH(::tidal::Error, cond, __VA_ARGS__)

// Unconditional throw of a typed error, for branches that are already known bad.
#define TIDAL_THROW(ErrorType, ...) \
  ::tidal::detail::throw_error<ErrorType>(__FILE__, __LINE__, ::tidal::detail::str_cat(__VA_ARGS__))

#define TIDAL_INTERNAL_ASSERT(cond, ...)                                  \
  do {                                                                    \
    if (TIDAL_UNLIKELY(!(cond))) {                                        \
      ::tidal::detail::throw_internal(#cond, __FILE__, __LINE__,          \
                                      ::tidal::detail::str_cat(__VA_ARGS__)); \
    }                                                                     \
  } while (false)

#if defined(TIDAL_DEBUG_FULL) || !defined(NDEBUG)
#define TIDAL_DEBUG_CHECKS_ENABLED 1
#define TIDAL_INTERNAL_ASSERT_DEBUG_ONLY(cond, ...) TIDAL_INTERNAL_ASSERT(cond, __VA_ARGS__)
#else
#define TIDAL_DEBUG_CHECKS_ENABLED 0
// sizeof keeps the condition type-checked without evaluating it.
#define TIDAL_INTERNAL_ASSERT_DEBUG_ONLY(cond, ...) \
  do {                                              \
    (void)sizeof((cond) ? 1 : 0);                   \
  } while (false)
#endif

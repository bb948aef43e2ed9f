#pragma once

// Private: the text of an exception in flight, for messages that wrap it.

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace mpipe {
namespace detail {

/// What `e` says: a c10::Error without its backtrace, a std::exception's
/// what(), or "unknown exception".
inline std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace detail
}  // namespace mpipe

// The refusal of the framework-free checks (api.h: the *_check functions, timeout_check,
// plan_combine_sizes): the reason, formatted into the caller's buffer, and
// petitErrorInvalidValue. One formatting path (vsnprintf) for every message; the torch binding
// and EpContext raise the text as it is.
#pragma once

#include <stdarg.h>
#include <stdio.h>

#include "common/platform.h"

namespace petit {

// Writes the reason of a refused call into err (nullptr or err_len <= 0: none) and returns
// petitErrorInvalidValue.
__attribute__((format(printf, 3, 4))) inline petitError_t refuse(char* err, int err_len,
                                                                 const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, size_t(err_len), fmt, args);
    va_end(args);
  }
  return petitErrorInvalidValue;
}

}  // namespace petit

// Status helpers shared by every smat library.
//
// Abseil 20220623 (Debian 12) has absl::Status and absl::StatusOr but no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so they live here. Functions that can
// fail for reasons outside the program return absl::Status or StatusOr<T>;
// CHECK-style aborts (SMAT_CHECK) are for programmer errors only.
//
//   absl::StatusOr<Tensor> LoadWeights(const std::string& path) {
//     SMAT_ASSIGN_OR_RETURN(NpyArray a, ReadNpy(path));
//     SMAT_RETURN_IF_ERROR(CheckShape(a, {4, 4}));
//     ...
//   }
#pragma once

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define SMAT_STATUS_CONCAT_INNER_(a, b) a##b
#define SMAT_STATUS_CONCAT_(a, b) SMAT_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define SMAT_RETURN_IF_ERROR(expr)                   \
  do {                                               \
    ::absl::Status smat_status_ = (expr);            \
    if (!smat_status_.ok()) return smat_status_;     \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else
// moves the value into `lhs` (a declaration such as `Tensor t` or an lvalue).
#define SMAT_ASSIGN_OR_RETURN(lhs, rexpr) \
  SMAT_ASSIGN_OR_RETURN_IMPL_(SMAT_STATUS_CONCAT_(smat_statusor_, __LINE__), lhs, rexpr)
#define SMAT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

// Programmer errors only (broken invariants), never bad user input.
#define SMAT_CHECK(cond)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__,  \
                   #cond);                                                    \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

namespace smat {

// Prefixes a status message with context, keeping its code:
//   return Annotate(status, "reading ", path);
template <typename... Args>
absl::Status Annotate(const absl::Status& s, const Args&... context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context..., ": ", s.message()));
}

}  // namespace smat

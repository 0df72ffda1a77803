// The two status macros abseil 20220623 lacks (defined once, used everywhere).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KV_STATUS_CONCAT_INNER(a, b) a##b
#define KV_STATUS_CONCAT(a, b) KV_STATUS_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    if (absl::Status kv_status_ = (expr); !kv_status_.ok()) \
      return kv_status_;                             \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): evaluates a StatusOr, returns its status on
// error, else move-assigns its value to `lhs` (which may be a declaration).
#define ASSIGN_OR_RETURN(lhs, expr) \
  KV_ASSIGN_OR_RETURN_IMPL(KV_STATUS_CONCAT(kv_statusor_, __LINE__), lhs, expr)
#define KV_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                             \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

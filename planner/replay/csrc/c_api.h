// The plan allocator's C interface, the same in every backend library: plans, steps, routed
// allocation and free, and counters. Each backend defines memplan::registry() for its device.
#pragma once

#include <cstdint>

#include "plan_core.h"

namespace memplan {
Registry& registry();  // defined by the backend (CPU memory or CUDA memory)
}

extern "C" {
// Number of int64 counters memplan_plan_stats writes, in PlanStats' field order.
int64_t memplan_stats_fields();
// A plan of n planned allocations (offset, size) and n_reserved slots of buffers that predate the
// step, over an arena of arena_bytes; each block holds its size rounded up to `alignment`.
// Returns a handle > 0, or 0 when the arena cannot be had.
int64_t memplan_plan_create(const int64_t* offsets, const int64_t* sizes, int64_t n,
                            const int64_t* reserved_offsets, const int64_t* reserved_sizes,
                            int64_t n_reserved, int64_t arena_bytes, int64_t alignment);
int memplan_step_begin(int64_t handle);  // 1 on success, 0 for unknown handle or open step
int memplan_step_end(int64_t handle);
// Inside a step: from the plan (or its counted fallback). Outside: straight from the system.
void* memplan_alloc(int64_t nbytes);
// Frees any block memplan_alloc returned, whichever plan (live or released) owns it.
void memplan_dealloc(void* ptr);
int memplan_plan_stats(int64_t handle, int64_t* out);
int memplan_plan_release(int64_t handle);
int64_t memplan_plans_alive();
}

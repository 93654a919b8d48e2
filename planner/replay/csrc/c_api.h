// The plan allocator's C interface, the same in every backend library: plans, steps, adoption,
// routed allocation and free, and counters. Each backend defines memplan::registry() for its device.
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
// Reserved slots are free until adopted. Returns a handle > 0, 0 when the arena cannot be had, or -1 for an
// invalid plan: an alignment below 1, a negative offset, size or arena, or a slot (its size rounded up to the
// alignment) that does not end inside the arena, every sum checked for int64 overflow.
int64_t memplan_plan_create(const int64_t* offsets, const int64_t* sizes, int64_t n,
                            const int64_t* reserved_offsets, const int64_t* reserved_sizes,
                            int64_t n_reserved, int64_t arena_bytes, int64_t alignment);
// One step or adoption is open at a time in the process. Begin: 1 on success, 0 for an unknown or
// released handle or while a step or adoption is open. End: 1 on success, 0 unless this handle has
// that phase open.
int memplan_step_begin(int64_t handle);
int memplan_step_end(int64_t handle);
// Adoption moves storages that predate the step into the arena: while it is open, a request of n
// bytes takes the first reserved slot of requested size exactly n that is not adopted yet and
// overlaps no live block; any other request is a counted fallback. Adopted blocks are freed like
// any other; a slot is adopted at most once.
int memplan_adopt_begin(int64_t handle);
int memplan_adopt_end(int64_t handle);
// Inside a step or adoption: from the plan (or its counted fallback). Outside: from the system.
void* memplan_alloc(int64_t nbytes);
// Frees any block memplan_alloc returned, whichever plan (live or released) owns it.
void memplan_dealloc(void* ptr);
int memplan_plan_stats(int64_t handle, int64_t* out);
// The base address of the plan's arena (blocks lie in [base, base + arena_bytes)); NULL for an
// unknown handle (or one released and freed) or an empty arena.
void* memplan_plan_arena(int64_t handle);
int memplan_plan_release(int64_t handle);
int64_t memplan_plans_alive();
}

// The C interface over the backend's registry (see c_api.h).
#include "c_api.h"

#include <vector>

namespace {

std::vector<int64_t> copy_of(const int64_t* p, int64_t n) {
  return n > 0 ? std::vector<int64_t>(p, p + n) : std::vector<int64_t>();
}

}  // namespace

extern "C" {

int64_t memplan_stats_fields() { return sizeof(memplan::PlanStats) / sizeof(int64_t); }

int64_t memplan_plan_create(const int64_t* offsets, const int64_t* sizes, int64_t n,
                            const int64_t* reserved_offsets, const int64_t* reserved_sizes,
                            int64_t n_reserved, int64_t arena_bytes, int64_t alignment) {
  std::vector<std::pair<int64_t, int64_t>> reserved;
  for (int64_t i = 0; i < n_reserved; ++i)
    reserved.emplace_back(reserved_offsets[i], reserved_sizes[i]);
  return memplan::registry().create(copy_of(offsets, n), copy_of(sizes, n), reserved, arena_bytes,
                                    alignment);
}

int memplan_step_begin(int64_t handle) {
  return memplan::registry().begin(handle, memplan::Phase::kStep) ? 1 : 0;
}

int memplan_step_end(int64_t handle) {
  return memplan::registry().end(handle, memplan::Phase::kStep) ? 1 : 0;
}

int memplan_adopt_begin(int64_t handle) {
  return memplan::registry().begin(handle, memplan::Phase::kAdopt) ? 1 : 0;
}

int memplan_adopt_end(int64_t handle) {
  return memplan::registry().end(handle, memplan::Phase::kAdopt) ? 1 : 0;
}

void* memplan_alloc(int64_t nbytes) {
  if (nbytes <= 0) return nullptr;
  void* p = nullptr;
  if (memplan::registry().allocate_in_phase(static_cast<size_t>(nbytes), &p)) return p;
  return memplan::registry().system().alloc(static_cast<size_t>(nbytes));
}

void memplan_dealloc(void* ptr) {
  if (ptr == nullptr) return;
  if (!memplan::registry().deallocate(ptr)) memplan::registry().system().free(ptr);
}

int memplan_plan_stats(int64_t handle, int64_t* out) {
  memplan::PlanStats s;
  if (!memplan::registry().stats(handle, &s)) return 0;
  const int64_t* fields = reinterpret_cast<const int64_t*>(&s);
  for (int64_t i = 0; i < memplan_stats_fields(); ++i) out[i] = fields[i];
  return 1;
}

void* memplan_plan_arena(int64_t handle) { return memplan::registry().arena(handle); }

int memplan_plan_release(int64_t handle) { return memplan::registry().release(handle) ? 1 : 0; }

int64_t memplan_plans_alive() { return static_cast<int64_t>(memplan::registry().plans_alive()); }
}

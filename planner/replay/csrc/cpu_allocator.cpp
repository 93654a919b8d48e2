// The CPU backend: a c10::Allocator over the plan registry, installed with c10::SetCPUAllocator
// for the replayed steps and the previous allocator restored after; a Python module (pybind).
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <cstring>
#include <stdexcept>

#include "c_api.h"

namespace {

void plan_delete(void* ptr) {
  c10::profiledCPUMemoryReporter().Delete(ptr);
  memplan_dealloc(ptr);
}

// Inside an open step or adoption every request goes to the plan; outside, to the allocator it replaced.
class PlanCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = nullptr;
    if (nbytes > 0 && memplan::registry().allocate_in_phase(nbytes, &p)) {
      if (p == nullptr) throw std::bad_alloc();
      c10::profiledCPUMemoryReporter().New(p, nbytes);
      return {p, p, &plan_delete, c10::Device(c10::DeviceType::CPU)};
    }
    return previous_->allocate(nbytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &plan_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  void set_previous(c10::Allocator* previous) { previous_ = previous; }
  c10::Allocator* previous() const { return previous_; }

 private:
  c10::Allocator* previous_ = nullptr;
};

PlanCPUAllocator& plan_allocator() {
  static PlanCPUAllocator* a = new PlanCPUAllocator();  // never destroyed: its blocks may outlive it
  return *a;
}

constexpr uint8_t kPriority = 100;  // above the default allocator's 0

void install() {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &plan_allocator()) throw std::runtime_error("the plan allocator is already installed");
  plan_allocator().set_previous(current);
  c10::SetCPUAllocator(&plan_allocator(), kPriority);
}

void restore() {
  if (c10::GetCPUAllocator() != &plan_allocator()) throw std::runtime_error("the plan allocator is not installed");
  c10::SetCPUAllocator(plan_allocator().previous(), kPriority);
}

bool installed() { return c10::GetCPUAllocator() == &plan_allocator(); }

int64_t create(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
               const std::vector<int64_t>& reserved_offsets, const std::vector<int64_t>& reserved_sizes,
               int64_t arena_bytes, int64_t alignment) {
  TORCH_CHECK(offsets.size() == sizes.size(), "offsets and sizes differ in length");
  TORCH_CHECK(reserved_offsets.size() == reserved_sizes.size(), "reserved offsets and sizes differ in length");
  return memplan_plan_create(offsets.data(), sizes.data(), static_cast<int64_t>(offsets.size()),
                             reserved_offsets.data(), reserved_sizes.data(),
                             static_cast<int64_t>(reserved_offsets.size()), arena_bytes, alignment);
}

std::vector<int64_t> stats(int64_t handle) {
  std::vector<int64_t> out(static_cast<size_t>(memplan_stats_fields()));
  TORCH_CHECK(memplan_plan_stats(handle, out.data()), "unknown plan handle ", handle);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memplan's plan allocator behind PyTorch's CPU allocator";
  m.def("install", &install, "Make the plan allocator PyTorch's CPU allocator");
  m.def("restore", &restore, "Put back the CPU allocator that install() replaced");
  m.def("installed", &installed);
  m.def("create", &create, "A plan over a new arena; returns its handle (0 if the arena cannot be had, -1 for an invalid plan)");
  m.def("begin_step", [](int64_t h) { return memplan_step_begin(h) == 1; });
  m.def("end_step", [](int64_t h) { return memplan_step_end(h) == 1; });
  m.def("begin_adopt", [](int64_t h) { return memplan_adopt_begin(h) == 1; });
  m.def("end_adopt", [](int64_t h) { return memplan_adopt_end(h) == 1; });
  m.def("arena_base", [](int64_t h) { return reinterpret_cast<intptr_t>(memplan_plan_arena(h)); },
        "The arena's base address (0 for an unknown handle)");
  m.def("stats", &stats, "The plan's counters in PlanStats field order");
  m.def("release", [](int64_t h) { return memplan_plan_release(h) == 1; });
  m.def("plans_alive", []() { return memplan_plans_alive(); });
}

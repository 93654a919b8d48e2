// The plan allocator's core: serves the k-th allocation of a step from base + offset[k] of one
// arena, moves pre-existing storages into their reserved slots when asked (adoption), never hands
// out a range overlapping a live one, and falls back to the system allocator (counted) on any
// divergence. One copy of this core sits behind every backend (CPU, CUDA, C).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace memplan {

// Where the arena and the fallback blocks come from: malloc-like functions of one device.
struct SystemMemory {
  void* (*alloc)(size_t nbytes);  // returns nullptr on failure
  void (*free)(void* ptr);
};

// Counters of one plan; every figure is in bytes or allocations.
struct PlanStats {
  int64_t arena_bytes = 0;       // size of the arena reserved for the plan
  int64_t adopted_count = 0;     // adoption requests served from a reserved slot
  int64_t adopted_bytes = 0;     // their requested bytes
  int64_t planned_count = 0;     // step allocations served at their planned offset
  int64_t fallback_count = 0;    // requests in a step or adoption served by the system allocator
  int64_t fallback_bytes = 0;    // their total bytes
  int64_t fallback_peak = 0;     // most fallback bytes live at once
  int64_t refused_in_use = 0;    // fallbacks: the planned (or reserved) range overlapped a live block
  int64_t size_mismatch = 0;     // fallbacks because the size differed from the plan's
  int64_t extra = 0;             // fallbacks because the step had more allocations than the plan
  int64_t no_slot = 0;           // adoption fallbacks: no reserved slot of that exact size left
  int64_t missing = 0;           // planned allocations a step never asked for
  int64_t arena_top_peak = 0;    // highest arena byte held by a live block (adopted or planned)
  int64_t held_peak = 0;         // most of (arena top + fallback bytes live) at any moment
  int64_t steps = 0;             // steps ended
  int64_t live_blocks = 0;       // blocks (arena or fallback) not yet freed
};

// What an open plan serves: the planned allocations of a step, or the adoption of reserved slots.
enum class Phase { kNone, kStep, kAdopt };

// One plan over one arena. Not synchronised itself: the Registry serialises every call.
class PlanCore {
 public:
  // offsets/sizes: the plan's slot of the k-th allocation of a step. reserved (offset, size):
  // slots of buffers that predate the step; they are free until adopted, and only an adoption
  // request of exactly that size takes one (once). A block holds its size rounded up to
  // `alignment` bytes (the plan's alignment), as the plan assumed.
  PlanCore(std::vector<int64_t> offsets, std::vector<int64_t> sizes,
           const std::vector<std::pair<int64_t, int64_t>>& reserved, int64_t arena_bytes,
           int64_t alignment, SystemMemory sys);
  ~PlanCore();
  PlanCore(const PlanCore&) = delete;
  PlanCore& operator=(const PlanCore&) = delete;

  // A plan is valid when the alignment is positive and every slot (offset, size) has a non-negative offset and
  // size and ends, its size rounded up to the alignment, inside the arena, all without overflowing int64 (checked
  // arithmetic: an offset near 2**63 or an alignment of 2**63 - 64 is refused, never wrapped around). An invalid
  // plan gets no arena and serves nothing.
  static bool valid(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                    const std::vector<std::pair<int64_t, int64_t>>& reserved, int64_t arena_bytes,
                    int64_t alignment);
  bool arena_ok() const { return arena_bytes_ == 0 || base_ != nullptr; }
  void* base() const { return base_; }
  void begin(Phase phase);  // a step starts again at the plan's first allocation
  void end();               // a step counts the planned allocations it never asked for
  Phase phase() const { return phase_; }
  void* allocate(size_t nbytes);  // nullptr only when the system allocator fails too
  bool owns(const void* ptr) const;
  void deallocate(void* ptr);     // ptr must be owned
  bool idle() const { return live_.empty() && fallback_.empty(); }
  PlanStats stats() const;

 private:
  bool fits(int64_t begin, int64_t end) const;  // inside the arena and clear of every live block
  void* planned(size_t nbytes);
  void* adopted(size_t nbytes);
  void note_peak();
  void* fall_back(size_t nbytes, int64_t* reason);
  // A block's bytes: its size rounded up to the alignment (valid() proved it fits int64 for every slot).
  int64_t extent(int64_t nbytes) const { return (nbytes + alignment_ - 1) / alignment_ * alignment_; }

  std::vector<int64_t> offsets_, sizes_;
  int64_t arena_bytes_;
  int64_t alignment_;
  SystemMemory sys_;
  char* base_ = nullptr;
  Phase phase_ = Phase::kNone;
  size_t cursor_ = 0;                         // index of the next planned allocation in the step
  std::map<int64_t, int64_t> live_;           // arena blocks (planned or adopted): begin -> end
  // requested size -> offsets of the reserved slots of that size not adopted yet, in plan order
  std::unordered_map<int64_t, std::vector<int64_t>> unadopted_;
  std::unordered_map<void*, int64_t> fallback_;  // fallback blocks -> bytes
  int64_t fallback_live_ = 0;
  PlanStats stats_;
};

// Every live plan of one process, behind one mutex: creates and releases plans, opens and closes
// steps and adoptions, and routes each allocation to the open plan and each free back to its owner.
class Registry {
 public:
  explicit Registry(SystemMemory sys) : sys_(sys) {}
  // Returns a handle > 0, 0 when the arena could not be allocated, or -1 for an invalid plan (PlanCore::valid).
  int64_t create(std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                 const std::vector<std::pair<int64_t, int64_t>>& reserved, int64_t arena_bytes,
                 int64_t alignment);
  // Opens a step or an adoption; false for an unknown or released handle or when one is open.
  bool begin(int64_t handle, Phase phase);
  // Closes it; false unless this handle has this phase open.
  bool end(int64_t handle, Phase phase);
  // Allocation while a step or adoption is open goes to its plan; false when none is open.
  bool allocate_in_phase(size_t nbytes, void** out);
  // Frees a block of any plan (even a released one); returns false when no plan owns it.
  bool deallocate(void* ptr);
  bool stats(int64_t handle, PlanStats* out);
  void* arena(int64_t handle);  // the plan's arena base; nullptr for an unknown handle
  // The owner lets go of the plan; its arena is freed once its last block is gone.
  bool release(int64_t handle);
  size_t plans_alive();
  SystemMemory system() const { return sys_; }

 private:
  void drop_if_done(int64_t handle);

  SystemMemory sys_;
  std::mutex mu_;
  int64_t next_ = 1;
  int64_t open_ = 0;  // handle of the plan whose step or adoption is open, 0 when none
  struct Entry {
    std::unique_ptr<PlanCore> core;
    bool released = false;
  };
  std::map<int64_t, Entry> plans_;
};

}  // namespace memplan

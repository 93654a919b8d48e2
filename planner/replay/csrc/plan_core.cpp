// The plan allocator's core and the registry that routes allocations and frees to it.
#include "plan_core.h"

#include <algorithm>
#include <utility>

namespace memplan {

namespace {

// True when [begin, end) overlaps an interval of `m` (intervals in `m` are pairwise disjoint).
bool overlaps(const std::map<int64_t, int64_t>& m, int64_t begin, int64_t end) {
  auto it = m.lower_bound(end);
  if (it == m.begin()) return false;
  --it;
  return it->second > begin;
}

// Whether [offset, offset + size rounded up to alignment) lies inside [0, arena); every sum is checked, so a slot
// whose end does not fit int64 is refused rather than wrapped around to a small or negative number.
bool slot_fits(int64_t offset, int64_t size, int64_t arena, int64_t alignment) {
  int64_t padded = 0, end = 0;
  if (offset < 0 || size < 0 || __builtin_add_overflow(size, alignment - 1, &padded)) return false;
  if (__builtin_add_overflow(offset, padded / alignment * alignment, &end)) return false;
  return end <= arena;
}

}  // namespace

bool PlanCore::valid(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                     const std::vector<std::pair<int64_t, int64_t>>& reserved, int64_t arena_bytes,
                     int64_t alignment) {
  if (alignment < 1 || arena_bytes < 0 || offsets.size() != sizes.size()) return false;
  for (size_t k = 0; k < offsets.size(); ++k)
    if (!slot_fits(offsets[k], sizes[k], arena_bytes, alignment)) return false;
  for (const auto& r : reserved)
    if (!slot_fits(r.first, r.second, arena_bytes, alignment)) return false;
  return true;
}

PlanCore::PlanCore(std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                   const std::vector<std::pair<int64_t, int64_t>>& reserved, int64_t arena_bytes,
                   int64_t alignment, SystemMemory sys)
    : offsets_(std::move(offsets)),
      sizes_(std::move(sizes)),
      arena_bytes_(arena_bytes),
      alignment_(alignment > 0 ? alignment : 1),
      sys_(sys) {
  if (arena_bytes_ > 0) base_ = static_cast<char*>(sys_.alloc(static_cast<size_t>(arena_bytes_)));
  for (const auto& r : reserved)
    if (r.second > 0) unadopted_[r.second].push_back(r.first);
  stats_.arena_bytes = arena_bytes_;
}

PlanCore::~PlanCore() {
  for (auto& f : fallback_) sys_.free(f.first);
  if (base_ != nullptr) sys_.free(base_);
}

void PlanCore::begin(Phase phase) {
  phase_ = phase;
  cursor_ = 0;
}

void PlanCore::end() {
  if (phase_ == Phase::kStep) {
    if (cursor_ < offsets_.size()) stats_.missing += static_cast<int64_t>(offsets_.size() - cursor_);
    stats_.steps += 1;
  }
  phase_ = Phase::kNone;
  cursor_ = 0;
}

bool PlanCore::fits(int64_t begin, int64_t end) const {
  return base_ != nullptr && begin >= 0 && end <= arena_bytes_ && !overlaps(live_, begin, end);
}

void PlanCore::note_peak() {
  int64_t top = live_.empty() ? 0 : live_.rbegin()->second;
  stats_.arena_top_peak = std::max(stats_.arena_top_peak, top);
  stats_.fallback_peak = std::max(stats_.fallback_peak, fallback_live_);
  stats_.held_peak = std::max(stats_.held_peak, top + fallback_live_);
}

void* PlanCore::fall_back(size_t nbytes, int64_t* reason) {
  void* p = sys_.alloc(nbytes);
  if (p == nullptr) return nullptr;
  fallback_.emplace(p, static_cast<int64_t>(nbytes));
  fallback_live_ += static_cast<int64_t>(nbytes);
  stats_.fallback_count += 1;
  stats_.fallback_bytes += static_cast<int64_t>(nbytes);
  if (reason != nullptr) *reason += 1;
  note_peak();
  return p;
}

void* PlanCore::allocate(size_t nbytes) {
  if (nbytes == 0) return nullptr;  // a size-0 request touches no memory and has no slot
  if (phase_ == Phase::kAdopt) return adopted(nbytes);
  return planned(nbytes);
}

void* PlanCore::planned(size_t nbytes) {
  if (phase_ != Phase::kStep || cursor_ >= offsets_.size()) return fall_back(nbytes, &stats_.extra);
  size_t k = cursor_++;
  if (sizes_[k] != static_cast<int64_t>(nbytes)) return fall_back(nbytes, &stats_.size_mismatch);
  int64_t begin = offsets_[k], end = offsets_[k] + extent(sizes_[k]);
  if (!fits(begin, end)) return fall_back(nbytes, &stats_.refused_in_use);
  live_.emplace(begin, end);
  stats_.planned_count += 1;
  note_peak();
  return base_ + begin;
}

// The first reserved slot of exactly this size that is not adopted yet and clear of live blocks.
void* PlanCore::adopted(size_t nbytes) {
  int64_t size = static_cast<int64_t>(nbytes);
  auto it = unadopted_.find(size);
  if (it == unadopted_.end() || it->second.empty()) return fall_back(nbytes, &stats_.no_slot);
  std::vector<int64_t>& slots = it->second;
  for (auto slot = slots.begin(); slot != slots.end(); ++slot) {
    int64_t begin = *slot, end = *slot + extent(size);
    if (!fits(begin, end)) continue;
    slots.erase(slot);
    live_.emplace(begin, end);
    stats_.adopted_count += 1;
    stats_.adopted_bytes += size;
    note_peak();
    return base_ + begin;
  }
  return fall_back(nbytes, &stats_.refused_in_use);
}

bool PlanCore::owns(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  if (base_ != nullptr && p >= base_ && p < base_ + arena_bytes_) return true;
  return fallback_.count(const_cast<void*>(ptr)) != 0;
}

void PlanCore::deallocate(void* ptr) {
  char* p = static_cast<char*>(ptr);
  if (base_ != nullptr && p >= base_ && p < base_ + arena_bytes_) {
    live_.erase(static_cast<int64_t>(p - base_));
    return;
  }
  auto it = fallback_.find(ptr);
  if (it == fallback_.end()) return;
  fallback_live_ -= it->second;
  sys_.free(ptr);
  fallback_.erase(it);
}

PlanStats PlanCore::stats() const {
  PlanStats s = stats_;
  s.live_blocks = static_cast<int64_t>(live_.size() + fallback_.size());
  return s;
}

int64_t Registry::create(std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                         const std::vector<std::pair<int64_t, int64_t>>& reserved,
                         int64_t arena_bytes, int64_t alignment) {
  if (!PlanCore::valid(offsets, sizes, reserved, arena_bytes, alignment)) return -1;
  auto core = std::make_unique<PlanCore>(std::move(offsets), std::move(sizes), reserved,
                                         arena_bytes, alignment, sys_);
  if (!core->arena_ok()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  int64_t h = next_++;
  plans_[h].core = std::move(core);
  return h;
}

bool Registry::begin(int64_t handle, Phase phase) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(handle);
  if (it == plans_.end() || it->second.released || open_ != 0 || phase == Phase::kNone) return false;
  it->second.core->begin(phase);
  open_ = handle;
  return true;
}

bool Registry::end(int64_t handle, Phase phase) {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_ != handle || handle == 0 || plans_.at(handle).core->phase() != phase) return false;
  plans_.at(handle).core->end();
  open_ = 0;
  return true;
}

bool Registry::allocate_in_phase(size_t nbytes, void** out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_ == 0) return false;
  *out = plans_.at(open_).core->allocate(nbytes);
  return true;
}

bool Registry::deallocate(void* ptr) {
  if (ptr == nullptr) return true;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : plans_) {
    if (entry.second.core->owns(ptr)) {
      entry.second.core->deallocate(ptr);
      drop_if_done(entry.first);
      return true;
    }
  }
  return false;
}

bool Registry::stats(int64_t handle, PlanStats* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(handle);
  if (it == plans_.end()) return false;
  *out = it->second.core->stats();
  return true;
}

void* Registry::arena(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(handle);
  return it == plans_.end() ? nullptr : it->second.core->base();
}

bool Registry::release(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(handle);
  if (it == plans_.end() || it->second.released) return false;
  if (open_ == handle) {
    it->second.core->end();
    open_ = 0;
  }
  it->second.released = true;
  drop_if_done(handle);
  return true;
}

size_t Registry::plans_alive() {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

void Registry::drop_if_done(int64_t handle) {
  auto it = plans_.find(handle);
  if (it != plans_.end() && it->second.released && it->second.core->idle()) plans_.erase(it);
}

}  // namespace memplan

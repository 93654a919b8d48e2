// The CPU backend's system memory: 64-byte aligned blocks (as PyTorch's CPU allocator gives).
#include <cstdlib>

#include "c_api.h"

namespace memplan {

namespace {

void* cpu_alloc(size_t nbytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, nbytes == 0 ? 1 : nbytes) != 0) return nullptr;
  return p;
}

void cpu_free(void* p) { std::free(p); }

}  // namespace

Registry& registry() {
  static Registry* r = new Registry(SystemMemory{cpu_alloc, cpu_free});  // never destroyed: frees may come at exit
  return *r;
}

}  // namespace memplan

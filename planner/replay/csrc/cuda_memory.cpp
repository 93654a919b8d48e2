// The CUDA backend: system memory is cudaMalloc/cudaFree, and the two functions
// torch.cuda.memory.CUDAPluggableAllocator calls route every CUDA allocation through the plan.
#include <cuda_runtime_api.h>
#include <sys/types.h>

#include "c_api.h"

namespace memplan {

namespace {

void* cuda_alloc(size_t nbytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, nbytes) != cudaSuccess) return nullptr;
  return p;
}

void cuda_free(void* p) { cudaFree(p); }

}  // namespace

Registry& registry() {
  static Registry* r = new Registry(SystemMemory{cuda_alloc, cuda_free});  // never destroyed: frees may come at exit
  return *r;
}

}  // namespace memplan

extern "C" {

// Plans replay on device 0 (their arena is allocated there); other devices get plain cudaMalloc.
void* memplan_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)stream;
  if (device != 0) return size > 0 ? memplan::registry().system().alloc(static_cast<size_t>(size)) : nullptr;
  return memplan_alloc(static_cast<int64_t>(size));
}

void memplan_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  (void)stream;
  memplan_dealloc(ptr);
}
}

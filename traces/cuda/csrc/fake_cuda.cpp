// A CUDA device for fake tensors on a torch built without CUDA (traces/cuda/fake_device.py).
//
// Fake CUDA tensors carry no memory, so nothing here talks to a GPU. What a CPU-only build lacks is what the
// autograd engine asks of any accelerator tensor: a device guard (streams, events) and an accelerator to name
// (at::accelerator::getAccelerator, read through the CUDA hooks' hasCUDA()). This module gives both:
// - install(): registers a guard for CUDA (one device, one stream, events that do nothing), only where the
//   build has no CUDA guard of its own; it stays for the process, as only a fake CUDA tensor consults it there.
// - enable(on): makes the process's CUDA hooks say "CUDA is here" while a fake CUDA step runs, and restores
//   them after. The hooks object is created once, at torch's start, as the base CUDAHooksInterface (no data
//   members): its virtual table is swapped for that of FakeCUDAHooks, of the same layout, and swapped back.

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <cstring>
#include <typeinfo>

namespace {

using c10::DeviceIndex;
using c10::DeviceType;

// The guard of one CUDA device, 0, whose one stream is its default stream: nothing runs, so nothing waits.
struct FakeCUDAGuard final : public c10::impl::DeviceGuardImplInterface {
  static c10::Device cuda() { return c10::Device(DeviceType::CUDA, 0); }
  static c10::Stream stream() { return c10::Stream(c10::Stream::DEFAULT, cuda()); }
  DeviceType type() const override { return DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return cuda(); }
  c10::Device getDevice() const override { return cuda(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return stream(); }
  c10::Stream getDefaultStream(c10::Device) const override { return stream(); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return stream(); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  bool isStreamCapturing(const c10::Stream&) const override { return false; }
};

// The CUDA hooks while a fake CUDA step runs: one device, present, with a primary context.
struct FakeCUDAHooks final : public at::CUDAHooksInterface {
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  void deviceSynchronize(DeviceIndex) const override {}
};
static_assert(sizeof(FakeCUDAHooks) == sizeof(at::CUDAHooksInterface), "the swap needs one layout");

void* vtable_of(const void* object) {
  void* table;
  std::memcpy(&table, object, sizeof(table));
  return table;
}

void set_vtable(const void* object, void* table) {
  std::memcpy(const_cast<void*>(object), &table, sizeof(table));
}

void* original_hooks_table = nullptr;

// Whether this build has no CUDA of its own: its hooks are the base interface (exactly, or already swapped).
bool swappable(const at::CUDAHooksInterface& hooks) {
  static const FakeCUDAHooks fake;
  return typeid(hooks) == typeid(at::CUDAHooksInterface) || vtable_of(&hooks) == vtable_of(&fake);
}

}  // namespace

// Register the no-op CUDA guard where the build has none; false when it has its own (a CUDA build).
bool install() {
  if (c10::impl::hasDeviceGuardImpl(DeviceType::CUDA)) return false;
  static FakeCUDAGuard guard;
  c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].store(&guard);
  return true;
}

// Make the CUDA hooks report a device (on) or restore the build's own (off); false when the build has CUDA.
bool enable(bool on) {
  static const FakeCUDAHooks fake;
  const auto& hooks = at::detail::getCUDAHooks();
  if (!swappable(hooks)) return false;
  const bool swapped = vtable_of(&hooks) == vtable_of(&fake);
  if (on && !swapped) {
    original_hooks_table = vtable_of(&hooks);
    set_vtable(&hooks, vtable_of(&fake));
  } else if (!on && swapped) {
    set_vtable(&hooks, original_hooks_table);
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "a CUDA device for fake tensors on a torch built without CUDA";
  m.def("install", &install, "Register a no-op CUDA device guard where the build has none");
  m.def("enable", &enable, "Make the CUDA hooks report a device (true) or restore them (false)");
}

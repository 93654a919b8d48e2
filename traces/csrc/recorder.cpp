// memplan's step recorder: every allocation and free of one device, labelled as it happens.
//
// Real tensors: the recorder is c10's memory reporter for the thread (the slot the profiler uses), so
// the CPU allocator and CUDA's caching allocator call it synchronously with every allocation and free.
// Fake tensors: a meta allocator that reports each storage's creation and death the same way.
// Labels come from RecordFunction callbacks (the innermost aten op; the autograd engine's
// evaluate_function record with the node's sequence number; the record around Inductor's generated code)
// and from the module and phase the Python side sets. Nothing here allocates
// tensor memory, so a recorded step allocates exactly what an unrecorded one does.
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using StorageKey = int64_t;      // a storage's identity: its data address (cpu, cuda) or a counter (meta)
using LabelId = int32_t;         // index into the table of interned names (ops, modules); 0 is "none"
using SequenceNumber = int64_t;  // autograd's number of a forward op, and of the backward node it made

// The phase the Python side announces; a backward node running on any thread is always kBackward.
enum Phase : int8_t { kForward = 0, kBackward = 1, kOptimizer = 2, kOther = 3 };

// One allocation (size > 0) or free (size < 0) in the order the allocator saw them.
struct Event {
  StorageKey key;  // which storage
  int64_t size;    // bytes requested (allocation) or released (free, negated)
  LabelId op;      // innermost aten op that is not an allocation helper, else innermost aten op
  LabelId module;  // module path; in backward, the module of the forward op that made the node
  int8_t phase;    // Phase
};

// A storage alive now: what its allocation event said.
struct Live {
  int64_t order;  // allocation counter, so live storages list in allocation order
  Event event;
};

// One aten op (or region of Inductor code) being run on this thread.
struct OpFrame {
  const char* name;  // stable while the op runs
  bool helper;       // only obtains memory for an enclosing op (aten::empty, ...)
};

// Label state of one thread; the autograd engine runs CPU backward on the calling thread.
struct ThreadState {
  std::vector<OpFrame> ops;
  std::vector<SequenceNumber> nodes;  // sequence numbers of the autograd nodes being run, outermost first
  std::vector<LabelId> modules;       // pushed by the Python module hooks
};
thread_local ThreadState this_thread;

const char* const kHelpers[] = {"aten::empty",     "aten::empty_strided",     "aten::empty_like",
                                "aten::new_empty", "aten::new_empty_strided", "aten::empty_permuted",
                                "aten::resize_",   "aten::zeros",             "aten::zero_"};

bool is_helper(const char* name) {
  for (const char* h : kHelpers)
    if (std::strcmp(name, h) == 0) return true;
  return false;
}

bool is_aten(const char* name) { return std::strncmp(name, "aten::", 6) == 0; }

// torch.compile's Inductor code runs inside a user-scope record graph_N_inductor_wrapper_call (memplan compiles
// with profiler_mark_wrapper_call): what it allocates outside any aten op is its own buffers, labelled kInductor.
constexpr char kWrapperPrefix[] = "graph_";
constexpr char kWrapperSuffix[] = "_inductor_wrapper_call";
constexpr char kInductor[] = "inductor";

bool is_compiled_region(const char* name) {
  size_t length = std::strlen(name), prefix = sizeof(kWrapperPrefix) - 1, suffix = sizeof(kWrapperSuffix) - 1;
  return length > prefix + suffix && std::strncmp(name, kWrapperPrefix, prefix) == 0 &&
         std::strcmp(name + length - suffix, kWrapperSuffix) == 0;
}

class Recorder {
 public:
  LabelId intern(const std::string& name) {
    std::lock_guard<std::mutex> guard(mutex_);
    return intern_locked(name);
  }

  std::vector<std::string> names() {
    std::lock_guard<std::mutex> guard(mutex_);
    return names_;
  }

  void set_phase(int8_t phase) { phase_.store(phase); }
  int8_t phase() const { return phase_.load(); }
  bool active() const { return active_.load(); }

  // claimed_only: keep only storages claim() names (fake tensors the program saw), not the meta
  // storages fake tensor mode makes for its own work.
  void start(c10::DeviceType device, int64_t index, bool claimed_only) {
    std::lock_guard<std::mutex> guard(mutex_);
    device_ = device;
    device_index_ = index;
    claimed_only_ = claimed_only;
    claimed_.clear();
    live_.clear();
    events_.clear();
    module_of_node_.clear();
    stepping_ = false;
    order_ = 0;
    phase_.store(kOther);
    active_.store(true);
  }

  void stop() { active_.store(false); }

  bool wants(const c10::Device& device) const {
    return device.type() == device_ && (device_index_ < 0 || device.index() == device_index_);
  }

  void note_node_module(SequenceNumber seq, LabelId module) {
    std::lock_guard<std::mutex> guard(mutex_);
    module_of_node_[seq] = module;
  }

  void claim(StorageKey key) {
    std::lock_guard<std::mutex> guard(mutex_);
    claimed_.insert(key);
  }

  void allocated(StorageKey key, int64_t nbytes) {
    if (!active() || nbytes <= 0) return;
    std::lock_guard<std::mutex> guard(mutex_);
    Event e = labelled(key, nbytes);
    live_[key] = Live{order_++, e};
    if (stepping_) events_.push_back(e);
  }

  // A storage made before recording began, counted as alive from now on so that its free is seen.
  void adopt(StorageKey key, int64_t nbytes) {
    if (!active() || nbytes <= 0) return;
    std::lock_guard<std::mutex> guard(mutex_);
    if (live_.count(key) == 0) live_[key] = Live{order_++, Event{key, nbytes, 0, 0, kOther}};
  }

  void freed(StorageKey key) {
    if (!active()) return;
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = live_.find(key);
    if (it == live_.end()) return;  // allocated before the recorder started: not part of the capture
    Event e = labelled(key, -it->second.event.size);
    live_.erase(it);
    if (stepping_) events_.push_back(e);
  }

  // The storages alive now, in allocation order; the events from here on are the step's.
  std::vector<Event> begin_step() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<const Live*> alive;
    alive.reserve(live_.size());
    for (const auto& kv : live_) alive.push_back(&kv.second);
    std::sort(alive.begin(), alive.end(), [](const Live* a, const Live* b) { return a->order < b->order; });
    std::vector<Event> out;
    out.reserve(alive.size());
    for (const Live* l : alive)
      if (kept(l->event)) out.push_back(l->event);
    events_.clear();
    stepping_ = true;
    return out;
  }

  // Events of the step so far that the trace keeps (claims are made as each op returns, so between
  // ops this is final).
  int64_t step_events() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!claimed_only_) return static_cast<int64_t>(events_.size());
    return std::count_if(events_.begin(), events_.end(), [this](const Event& e) { return kept(e); });
  }

  std::vector<Event> end_step() {
    std::lock_guard<std::mutex> guard(mutex_);
    stepping_ = false;
    std::vector<Event> out;
    out.reserve(events_.size());
    for (const Event& e : events_)
      if (kept(e)) out.push_back(e);
    events_.clear();
    return out;
  }

 private:
  bool kept(const Event& e) const { return !claimed_only_ || claimed_.count(e.key) > 0; }

  LabelId intern_locked(const std::string& name) {
    auto it = ids_.find(name);
    if (it != ids_.end()) return it->second;
    LabelId id = static_cast<LabelId>(names_.size());
    names_.push_back(name);
    ids_.emplace(name, id);
    return id;
  }

  Event labelled(StorageKey key, int64_t size) {
    const ThreadState& t = this_thread;
    LabelId op = 0;
    for (auto it = t.ops.rbegin(); it != t.ops.rend(); ++it) {
      if (!it->helper) {
        op = intern_locked(it->name);
        break;
      }
    }
    if (op == 0 && !t.ops.empty()) op = intern_locked(t.ops.back().name);
    LabelId module = t.modules.empty() ? 0 : t.modules.back();
    int8_t phase = phase_.load();
    if (!t.nodes.empty()) {  // a backward node (and any forward it recomputes) on this thread
      auto found = module_of_node_.find(t.nodes.front());
      module = found == module_of_node_.end() ? 0 : found->second;
      phase = kBackward;
    }
    return Event{key, size, op, module, phase};
  }

  std::mutex mutex_;
  std::vector<std::string> names_{""};  // id 0: none
  std::unordered_map<std::string, LabelId> ids_{{"", 0}};
  std::unordered_map<SequenceNumber, LabelId> module_of_node_;
  std::unordered_map<StorageKey, Live> live_;
  std::unordered_set<StorageKey> claimed_;
  bool claimed_only_ = false;
  std::vector<Event> events_;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  int64_t device_index_ = -1;
  bool stepping_ = false;
  int64_t order_ = 0;
  std::atomic<int8_t> phase_{kOther};
  std::atomic<bool> active_{false};
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: storages may report to it at exit
  return *r;
}

// c10's memory reporter: every allocator of the thread (and of threads that inherit its state) calls it.
// It sits in the profiler's slot, where torch reads a ProfilerStateBase, so it is one: a disabled
// profiler (profilerEnabled() stays false) that only wants memory reports.
struct Reporter final : public torch::profiler::impl::ProfilerStateBase {
  Reporter()
      : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::Disabled)) {}
  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }
  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t, size_t, c10::Device device) override {
    if (!recorder().wants(device)) return;
    if (alloc_size > 0)
      recorder().allocated(reinterpret_cast<StorageKey>(ptr), alloc_size);
    else if (alloc_size < 0)
      recorder().freed(reinterpret_cast<StorageKey>(ptr));
  }
  bool memoryProfilingEnabled() const override { return true; }
};

// The meta allocator behind fake tensors, reporting like a real one; data stays nullptr as meta's does,
// and the storage's key rides in the DataPtr's context so its deleter can report the free.
std::atomic<int64_t> next_meta_key{1};

void meta_free(void* context) { recorder().freed(reinterpret_cast<StorageKey>(context)); }

class RecordingMetaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, c10::Device(c10::DeviceType::Meta)};
    StorageKey key = next_meta_key.fetch_add(1);
    recorder().allocated(key, static_cast<int64_t>(nbytes));
    return {nullptr, reinterpret_cast<void*>(key), &meta_free, c10::Device(c10::DeviceType::Meta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}
};

RecordingMetaAllocator& meta_allocator() {
  static RecordingMetaAllocator* a = new RecordingMetaAllocator();  // its storages may outlive a capture
  return *a;
}

// The autograd engine runs each node inside a record of this name (its validate_outputs too, where
// broadcast gradients are summed); the number comes from the node's own apply record inside it.
constexpr char kEvaluateFunction[] = "autograd::engine::evaluate_function: ";
constexpr SequenceNumber kUnknownNode = -1;

bool is_node(const char* name) { return std::strncmp(name, kEvaluateFunction, sizeof(kEvaluateFunction) - 1) == 0; }

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  ThreadState& t = this_thread;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {  // a node's apply: number its evaluate frame
    if (!t.nodes.empty() && t.nodes.back() == kUnknownNode) t.nodes.back() = fn.seqNr();
    return nullptr;
  }
  const char* name = fn.name();
  if (is_node(name)) {
    t.nodes.push_back(kUnknownNode);
    return nullptr;
  }
  // A forward op reports the next sequence number until one creates the autograd node and takes it:
  // the last forward op with a number is the node's creator, and its module the node's module.
  int8_t phase = recorder().phase();
  if (fn.seqNr() >= 0 && t.nodes.empty() && phase != kBackward && phase != kOptimizer)
    recorder().note_node_module(fn.seqNr(), t.modules.empty() ? 0 : t.modules.back());
  if (is_aten(name))
    t.ops.push_back(OpFrame{name, is_helper(name)});
  else if (is_compiled_region(name))
    t.ops.push_back(OpFrame{kInductor, false});
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) return;
  ThreadState& t = this_thread;
  const char* name = fn.name();
  if (is_node(name)) {
    if (!t.nodes.empty()) t.nodes.pop_back();
  } else if ((is_aten(name) || is_compiled_region(name)) && !t.ops.empty()) {
    t.ops.pop_back();
  }
}

// What start() installed, for stop() to take away.
struct Installed {
  bool reporter = false;
  at::CallbackHandle callback = 0;
  c10::Allocator* previous_meta = nullptr;
};
Installed installed;

constexpr uint8_t kMetaPriority = 100;  // above the built-in meta allocator's 0

void start(const std::string& device_type, int64_t device_index, bool fake) {
  TORCH_CHECK(!recorder().active(), "the step recorder is already recording");
  c10::DeviceType type = c10::Device(device_type).type();
  recorder().start(fake ? c10::DeviceType::Meta : type, fake ? -1 : device_index, fake);
  this_thread = ThreadState{};
  if (fake) {
    installed.previous_meta = c10::GetAllocator(c10::DeviceType::Meta);
    c10::SetAllocator(c10::DeviceType::Meta, &meta_allocator(), kMetaPriority);
  } else {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, std::make_shared<Reporter>());
    installed.reporter = true;
  }
  installed.callback = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_enter, &on_exit)
          .needsIds(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION, at::RecordScope::USER_SCOPE}));
}

void stop() {
  recorder().stop();
  if (installed.callback) at::removeCallback(installed.callback);
  if (installed.reporter) c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  if (installed.previous_meta) c10::SetAllocator(c10::DeviceType::Meta, installed.previous_meta, kMetaPriority);
  installed = Installed{};
  this_thread = ThreadState{};
}

// Events as five parallel columns (key, size, op, module, phase) for the Python side.
py::tuple columns(const std::vector<Event>& events) {
  std::vector<int64_t> key, size;
  std::vector<int32_t> op, module;
  std::vector<int8_t> phase;
  for (const Event& e : events) {
    key.push_back(e.key);
    size.push_back(e.size);
    op.push_back(e.op);
    module.push_back(e.module);
    phase.push_back(e.phase);
  }
  return py::make_tuple(key, size, op, module, phase);
}

// A tensor's storage key: the data address, or for a meta (fake) storage the key its allocator gave.
int64_t storage_key(const at::Tensor& t) {
  const c10::Storage& storage = t.storage();
  if (storage.device_type() == c10::DeviceType::Meta)
    return reinterpret_cast<int64_t>(storage.data_ptr().get_context());
  return reinterpret_cast<int64_t>(storage.data_ptr().get());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memplan's step recorder: labelled allocations and frees of one device";
  m.def("start", &start, "Start recording (device type, device index or -1, fake)");
  m.def("stop", &stop, "Stop recording and remove everything start() installed");
  m.def("intern", [](const std::string& name) { return recorder().intern(name); });
  m.def("names", []() { return recorder().names(); }, "Interned names by id");
  m.def("enter_module", [](int32_t id) { this_thread.modules.push_back(id); });
  m.def("leave_module", []() {
    if (!this_thread.modules.empty()) this_thread.modules.pop_back();
  });
  m.def("set_phase", [](int8_t phase) { recorder().set_phase(phase); return recorder().step_events(); },
        "Set the phase; returns how many events the step has recorded so far");
  m.def("begin_step", []() { return columns(recorder().begin_step()); },
        "Storages alive now as columns; later events belong to the step");
  m.def("end_step", []() { return columns(recorder().end_step()); }, "The step's events as columns");
  m.def("storage_key", &storage_key);
  m.def("adopt", [](const at::Tensor& t) { recorder().adopt(storage_key(t), static_cast<int64_t>(t.storage().nbytes())); },
        "Count a tensor's storage, made before recording began, as alive from now on");
  m.def("claim", [](const at::Tensor& t) { recorder().claim(storage_key(t)); },
        "Keep the storage of this fake tensor in the capture");
}

// memplan's step recorder: every allocation and free of one device, labelled as it happens.
//
// Real tensors: the recorder is c10's memory reporter for the thread (the slot the profiler uses), so
// the CPU allocator and CUDA's caching allocator call it synchronously with every allocation and free; on CPU the
// allocator is wrapped too, so that a free on a thread without the reporter (a process group's worker) is seen.
// Fake tensors: a meta allocator that reports each storage's creation and death the same way.
// Labels come from RecordFunction callbacks (the op as fake tensors see it: the outermost aten or c10d op
// that is not a composite on the device; the autograd engine's evaluate_function record with the node's
// sequence number; the record around Inductor's generated code) and from the module and phase the Python
// side sets. Nothing here allocates tensor memory, so a recorded step allocates exactly what an unrecorded
// one does. Each allocation is also marked when that op returns its storage; the rest is kernels' own
// (scratch, wrapped Python numbers, a process group's staging buffers). A real step's op that reads a storage the
// recorder never saw allocated (made before recording began and not adopted: a frozen model built outside
// `record`, a tensor cached in a global) is noted once per storage, so the trace can say what it lacks. Counters of
// ops run and the latest allocation's module let another thread report a long capture's progress.
// libtorch is a release build (NDEBUG): RecordFunction's debug-only members and its check that inputs() is read in a
// start callback must be compiled as libtorch's are, or the check fails on every op (it is never armed there).
#ifndef NDEBUG
#define NDEBUG
#endif
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
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
  LabelId op;      // the op fake tensors see; else innermost aten op not an allocation helper; else innermost
  LabelId module;  // module path; in backward, the module of the forward op that made the node
  int8_t phase;    // Phase
  bool output;     // the storage was returned by an op fake tensors see (set when that op returns)
};

// A storage alive now: what its allocation event said.
struct Live {
  int64_t order;       // allocation counter, so live storages list in allocation order
  Event event;
  int64_t step_index;  // its allocation's index in the step's events, -1 if made before the step
};

// A storage a step's op read that is not in the capture: its bytes, and the op and module that read it first.
struct Unseen {
  int64_t nbytes;
  LabelId op;
  LabelId module;
};

// One aten op (or region of Inductor code) being run on this thread.
struct OpFrame {
  const char* name;  // stable while the op runs
  bool helper;       // only obtains memory for an enclosing op (aten::empty, ...)
  bool seen;         // an op fake tensors see: the outermost one not CompositeImplicitAutograd
  int64_t first;     // for a seen op, the allocation counter when it began
};

// Label state of one thread; the autograd engine runs CPU backward on the calling thread.
struct ThreadState {
  std::vector<OpFrame> ops;
  std::vector<SequenceNumber> nodes;  // sequence numbers of the autograd nodes being run, outermost first
  std::vector<std::string> node_names;  // their names (IndexBackward0, ...), likewise
  std::vector<LabelId> modules;       // pushed by the Python module hooks
  int seen_frames = 0;                // frames in `ops` with `seen` set (0 or 1)
  int applying = 0;                   // autograd nodes whose own apply (the backward formula) runs now
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

// An op of ATen or of torch.distributed's collectives (c10d::allreduce_, ...): what a frame is made for. A
// collective's own buffers (gloo's staging copies) are then its scratch, not outputs of the ops inside it.
bool is_op(const char* name) { return std::strncmp(name, "aten::", 6) == 0 || std::strncmp(name, "c10d::", 6) == 0; }

// Whether the op runs as the ops it is made of on `backend` (CompositeImplicitAutograd, with no kernel of its own
// there): those are what fake tensors (and any dispatch mode) see. Cached per backend and op name (a stable
// pointer into the op's schema).
bool is_composite(const at::RecordFunction& fn, c10::DispatchKey backend) {
  thread_local std::unordered_map<const char*, bool> cache[2];
  auto& known = cache[backend == c10::DispatchKey::CUDA];
  auto found = known.find(fn.name());
  if (found != known.end()) return found->second;
  bool composite = false;
  if (auto name = fn.operator_name()) {
    auto handle = c10::Dispatcher::singleton().findOp(*name);
    composite = handle && handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
                !handle->hasKernelForDispatchKey(backend) &&
                !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
                !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
  }
  return known[fn.name()] = composite;
}

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

// torch.tensor(data) allocates in aten::empty and then lifts the tensor (aten::lift_fresh, nothing allocated);
// under fake tensors the storage is made in the lift. Labelled aten::empty both ways.
constexpr char kLiftFresh[] = "aten::lift_fresh";
constexpr char kEmpty[] = "aten::empty";

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
  c10::DispatchKey backend() const { return backend_; }  // set before recording starts
  // Whether ops on this thread are the program's: the capturing thread's, and the autograd engine's (its device
  // threads run backward nodes), not a process group's worker threads (gloo's staging buffers are its own).
  bool programs(const ThreadState& t) const { return std::this_thread::get_id() == capturing_ || !t.nodes.empty(); }

  // claimed_only: keep only storages claim() names (fake tensors the program saw), not the meta
  // storages fake tensor mode makes for its own work.
  void start(c10::DeviceType device, c10::DeviceType backend, int64_t index, bool claimed_only) {
    std::lock_guard<std::mutex> guard(mutex_);
    device_ = device;
    capturing_ = std::this_thread::get_id();
    backend_ = backend == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
    device_index_ = index;
    claimed_only_ = claimed_only;
    claimed_.clear();
    inside_.clear();
    live_.clear();
    events_.clear();
    program_.clear();
    program_marks_.clear();
    adopted_.clear();
    counted_ = kept_events_ = 0;
    module_of_node_.clear();
    unseen_.clear();
    stepping_ = false;
    compiled_ = false;
    order_ = 0;
    ops_.store(0);
    last_module_.store(0);
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

  // `inside`: claimed by an op run inside another op fake tensors see (autograd's copy of an in-place op's input,
  // autocast's cast of a matmul's): not that op's output, as a real trace marks it.
  // A `view` (an op's output on an input's storage) never makes its storage internal: the op that made the storage
  // decided that, and, as a real trace marks it, any op outside another returning a view of it makes it an output
  // (DTensor views its local tensors inside each op it runs on them, and to_local returns them outside).
  void claim(StorageKey key, bool inside, bool view) {
    std::lock_guard<std::mutex> guard(mutex_);
    claimed_.insert(key);
    if (inside && !view)
      inside_.insert(key);
    else if (!inside)
      inside_.erase(key);
  }

  void allocated(StorageKey key, int64_t nbytes) {
    if (!active() || nbytes <= 0) return;
    std::lock_guard<std::mutex> guard(mutex_);
    Event e = labelled(key, nbytes);
    live_[key] = Live{order_++, e, stepping_ ? static_cast<int64_t>(events_.size()) : -1};
    if (stepping_)
      events_.push_back(e);
    else
      program_.push_back(e);
  }

  // An op fake tensors see returned this storage: its allocation was an op's output.
  void returned(StorageKey key) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = live_.find(key);
    if (it != live_.end() && it->second.step_index >= 0) events_[it->second.step_index].output = true;
  }

  // Give these storages' allocations, made during the step, the positions they hold now in the order given.
  void in_order(const std::vector<StorageKey>& keys) {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<int64_t> positions;
    std::vector<Event> allocations;
    for (StorageKey key : keys) {
      auto it = live_.find(key);
      if (it == live_.end() || it->second.step_index < 0) return;  // not all made in the step: leave them
      positions.push_back(it->second.step_index);
      allocations.push_back(events_[it->second.step_index]);
    }
    std::sort(positions.begin(), positions.end());
    for (size_t i = 0; i < keys.size(); ++i) {
      events_[positions[i]] = allocations[i];
      live_[keys[i]].step_index = positions[i];
    }
  }

  // The allocation counter: storages allocated from now on have this order or later.
  int64_t allocations() {
    std::lock_guard<std::mutex> guard(mutex_);
    return order_;
  }

  // An op that began at allocation counter `first` raised after computing its outputs (a checkpoint's saved-tensor
  // hook stops the recomputation that way): what it allocated and still holds was its output.
  void returned_since(int64_t first) {
    std::lock_guard<std::mutex> guard(mutex_);
    for (const auto& kv : live_)
      if (kv.second.order >= first && kv.second.step_index >= 0) events_[kv.second.step_index].output = true;
  }

  // torch.compile's code ran: it allocates its own buffers outside any op, so the output marks mean nothing.
  void saw_compiled_region() { compiled_ = true; }
  bool outputs_marked() const { return !compiled_; }

  // A storage made before recording began, counted as alive from now on so that its free is seen.
  void adopt(StorageKey key, int64_t nbytes) {
    if (!active() || nbytes <= 0) return;
    std::lock_guard<std::mutex> guard(mutex_);
    if (live_.count(key) == 0) {
      live_[key] = Live{order_++, Event{key, nbytes, 0, 0, kOther, true}, -1};
      adopted_.push_back(key);
    }
  }

  // An op of the step read this storage: noted once if the recorder never saw it allocated (not in the capture).
  void read(StorageKey key, int64_t nbytes) {
    if (!active() || nbytes <= 0) return;
    std::lock_guard<std::mutex> guard(mutex_);
    if (!stepping_ || live_.count(key) > 0 || unseen_.count(key) > 0) return;
    Event e = labelled(key, nbytes);
    unseen_[key] = Unseen{nbytes, e.op, e.module};
  }

  // The storages the step read and the capture lacks, largest first: (key, bytes, op, module) each.
  std::vector<std::tuple<StorageKey, int64_t, LabelId, LabelId>> unseen() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<std::tuple<StorageKey, int64_t, LabelId, LabelId>> out;
    for (const auto& kv : unseen_) out.emplace_back(kv.first, kv.second.nbytes, kv.second.op, kv.second.module);
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
      return std::get<1>(a) != std::get<1>(b) ? std::get<1>(a) > std::get<1>(b) : std::get<0>(a) < std::get<0>(b);
    });
    return out;
  }

  void ran_op() { ops_.fetch_add(1, std::memory_order_relaxed); }

  // A capture's progress so far, for another thread: ops run, the step's events, bytes live in the capture, the
  // phase, and the module of the latest allocation.
  py::tuple progress() {
    std::lock_guard<std::mutex> guard(mutex_);
    int64_t live_bytes = 0;
    for (const auto& kv : live_)
      if (kept(kv.second.event)) live_bytes += kv.second.event.size;
    LabelId module = last_module_.load(std::memory_order_relaxed);
    std::string name = module >= 0 && static_cast<size_t>(module) < names_.size() ? names_[module] : "";
    return py::make_tuple(ops_.load(std::memory_order_relaxed), static_cast<int64_t>(events_.size()), live_bytes,
                          static_cast<int>(phase_.load()), stepping_, name);
  }

  void freed(StorageKey key) {
    if (!active()) return;
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = live_.find(key);
    if (it == live_.end()) return;  // allocated before the recorder started: not part of the capture
    // Freed while an exception unwinds (a checkpoint's saved-tensor hook stopping a recomputation): its op
    // had made it and was handing it back.
    if (std::uncaught_exceptions() > 0 && it->second.step_index >= 0) events_[it->second.step_index].output = true;
    Event e = labelled(key, -it->second.event.size);
    live_.erase(it);
    if (stepping_)
      events_.push_back(e);
    else
      program_.push_back(e);
  }

  // A storage resized in place from `old_nbytes` to `nbytes` (FSDP2 frees its unsharded parameters by resizing their
  // storage to 0 and takes them back by resizing it again): a meta (fake) storage keeps its key, so the resize is a
  // free of the old bytes, then an allocation of the new ones.
  void resized(StorageKey key, int64_t old_nbytes, int64_t nbytes) {
    if (old_nbytes > 0) freed(key);
    if (nbytes > 0) allocated(key, nbytes);
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
    counted_ = kept_events_ = 0;
    stepping_ = true;
    return out;
  }

  // Events of the step so far that the trace keeps (claims are made as each op returns, so between
  // ops this is final, and the events counted once need no counting again: called between ops only).
  int64_t step_events() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!claimed_only_) return static_cast<int64_t>(events_.size());
    for (; counted_ < events_.size(); ++counted_)
      if (kept(events_[counted_])) ++kept_events_;
    return kept_events_;
  }

  std::vector<Event> end_step() {
    std::lock_guard<std::mutex> guard(mutex_);
    stepping_ = false;
    std::vector<Event> out;
    out.reserve(events_.size());
    for (const Event& e : events_)
      if (kept(e)) out.push_back(e);
    if (claimed_only_)  // fake: a claimed storage is the output of the op that claimed it, unless run inside another
      for (Event& e : out) e.output = inside_.count(e.key) == 0;
    program_.insert(program_.end(), out.begin(), out.end());  // the program's log holds the step as the step has it
    events_.clear();
    counted_ = kept_events_ = 0;
    return out;
  }

  // Mark a point of the program (a step's start or end); its index among the program's kept events is given by
  // program().
  void mark() {
    std::lock_guard<std::mutex> guard(mutex_);
    program_marks_.push_back(static_cast<int64_t>(program_.size()));
  }

  // The events logged outside a step since raw position `since` of the program's log, those kept now (claimed when
  // fake), and the log's length: a live consumer's next `since`.
  std::pair<std::vector<Event>, int64_t> program_tail(int64_t since) {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<Event> out;
    for (size_t i = static_cast<size_t>(std::max<int64_t>(since, 0)); i < program_.size(); ++i)
      if (kept(program_[i])) out.push_back(program_[i]);
    return {out, static_cast<int64_t>(program_.size())};
  }

  // Every kept event since start() in order (a recorded step's events as end_step gave them), the marks as indices
  // into them, and the storages adopted (alive before recording began), in order.
  std::tuple<std::vector<Event>, std::vector<int64_t>, std::vector<StorageKey>> program() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<Event> out;
    std::vector<int64_t> marks;
    size_t next = 0;
    for (size_t i = 0; i <= program_.size(); ++i) {
      for (; next < program_marks_.size() && program_marks_[next] == static_cast<int64_t>(i); ++next)
        marks.push_back(static_cast<int64_t>(out.size()));
      if (i < program_.size() && kept(program_[i])) out.push_back(program_[i]);
    }
    std::vector<StorageKey> adopted;
    for (StorageKey key : adopted_)
      if (!claimed_only_ || claimed_.count(key) > 0) adopted.push_back(key);
    return {out, marks, adopted};
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
    for (const OpFrame& frame : t.ops) {  // the op fake tensors see, so real and fake traces label alike
      if (frame.seen) op = intern_locked(std::strcmp(frame.name, kLiftFresh) == 0 ? kEmpty : frame.name);
    }
    for (auto it = t.ops.rbegin(); op == 0 && it != t.ops.rend(); ++it) {
      if (!it->helper) op = intern_locked(it->name);
    }
    if (op == 0 && !t.ops.empty()) op = intern_locked(t.ops.back().name);
    LabelId module = t.modules.empty() ? 0 : t.modules.back();
    int8_t phase = phase_.load();
    if (!t.nodes.empty()) {  // a backward node (and any forward it recomputes) on this thread
      auto found = module_of_node_.find(t.nodes.front());
      module = found == module_of_node_.end() ? 0 : found->second;
      phase = kBackward;
    }
    last_module_.store(module, std::memory_order_relaxed);
    return Event{key, size, op, module, phase, false};
  }

  std::mutex mutex_;
  std::vector<std::string> names_{""};  // id 0: none
  std::unordered_map<std::string, LabelId> ids_{{"", 0}};
  std::unordered_map<SequenceNumber, LabelId> module_of_node_;
  std::unordered_map<StorageKey, Live> live_;
  std::unordered_set<StorageKey> claimed_;
  std::unordered_set<StorageKey> inside_;  // claimed by an op run inside another op fake tensors see
  std::unordered_map<StorageKey, Unseen> unseen_;  // storages the step read that the capture lacks
  bool claimed_only_ = false;
  size_t counted_ = 0;  // step events step_events() has looked at, of which kept_events_ are kept
  int64_t kept_events_ = 0;
  std::vector<Event> events_;
  std::vector<Event> program_;          // every event since start(): outside a step as they came, a step's as kept
  std::vector<int64_t> program_marks_;  // mark()s: indices into program_
  std::vector<StorageKey> adopted_;     // storages adopted, in order
  c10::DeviceType device_ = c10::DeviceType::CPU;
  c10::DispatchKey backend_ = c10::DispatchKey::CPU;  // the kernels of the device recorded (faked)
  std::thread::id capturing_;                         // the thread that started the recording
  int64_t device_index_ = -1;
  bool stepping_ = false;
  bool compiled_ = false;
  int64_t order_ = 0;
  std::atomic<int8_t> phase_{kOther};
  std::atomic<bool> active_{false};
  std::atomic<int64_t> ops_{0};         // ops fake tensors see, run by the program since start()
  std::atomic<LabelId> last_module_{0};  // the module of the latest allocation or free
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

// Real CPU: a storage's last reference may be dropped on a thread that reports to no one. A process group's worker
// thread holds a collective's work (and its tensors) until it takes the next one; when the program has already
// dropped its own references (FSDP2's all-gather output after its copy-out), the free happens there. This wrapper of
// the CPU allocator gives every storage of the default allocator a deleter that reports such a free itself.
c10::DeleterFnPtr default_cpu_delete() {
  static const c10::DeleterFnPtr deleter = c10::GetDefaultCPUAllocator()->raw_deleter();
  return deleter;
}

// Whether this thread's frees reach the recorder through its Reporter (the capturing thread, the autograd engine's
// threads, a process group's worker while it runs a collective under the program's thread-local state).
bool reports_here() {
  return dynamic_cast<Reporter*>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE)) != nullptr;
}

// Recorded before the memory goes back, so no allocation can take its address first.
void reporting_delete(void* ptr) {
  if (!reports_here()) recorder().freed(reinterpret_cast<StorageKey>(ptr));
  default_cpu_delete()(ptr);
}

class ReportingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr data = previous_->allocate(nbytes);
    if (data.get() == data.get_context()) (void)data.compare_exchange_deleter(default_cpu_delete(), &reporting_delete);
    return data;
  }
  c10::DeleterFnPtr raw_deleter() const override {
    c10::DeleterFnPtr deleter = previous_->raw_deleter();
    return deleter == default_cpu_delete() ? &reporting_delete : deleter;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    previous_->copy_data(dest, src, count);
  }
  void set_previous(c10::Allocator* previous) { previous_ = previous; }
  c10::Allocator* previous() const { return previous_; }

 private:
  c10::Allocator* previous_ = nullptr;
};

ReportingCPUAllocator& reporting_cpu_allocator() {
  static ReportingCPUAllocator* a = new ReportingCPUAllocator();  // never destroyed: its storages may outlive it
  return *a;
}

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

// A tensor's storage key: the data address, or for a meta (fake) storage the key its allocator gave.
int64_t storage_key(const at::Tensor& t) {
  const c10::Storage& storage = t.storage();
  if (storage.device_type() == c10::DeviceType::Meta)
    return reinterpret_cast<int64_t>(storage.data_ptr().get_context());
  return reinterpret_cast<int64_t>(storage.data_ptr().get());
}

// The autograd engine runs each node inside a record of this name (its validate_outputs too, where
// broadcast gradients are summed); the number comes from the node's own apply record inside it.
constexpr char kEvaluateFunction[] = "autograd::engine::evaluate_function: ";
constexpr SequenceNumber kUnknownNode = -1;

bool is_node(const char* name) { return std::strncmp(name, kEvaluateFunction, sizeof(kEvaluateFunction) - 1) == 0; }

// Whether ops' inputs are checked for storages the capture lacks (a real capture: fake tensors are all made inside).
bool checks_reads = false;
// Whether ops' outputs are marked as they return (a real capture: a fake one marks what is claimed, in end_step, and
// asking a fake tensor its device would call into Python for each output).
bool marks_outputs = false;

// Note a read of the tensor's storage (a plain tensor of the recorded device; a Python subclass has none of its own).
void note_read(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.key_set().has(c10::DispatchKey::Python) || !recorder().wants(t.device()))
    return;
  const c10::Storage& storage = t.storage();
  if (storage.data() == nullptr) return;
  recorder().read(storage_key(t), static_cast<int64_t>(storage.nbytes()));
}

// Note the storages an op fake tensors see reads: its tensor and tensor-list inputs.
void note_reads(const at::RecordFunction& fn) {
  for (const c10::IValue& value : fn.inputs()) {
    if (value.isTensor()) {
      note_read(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) note_read(t);
    }
  }
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  ThreadState& t = this_thread;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {  // a node's apply: number its evaluate frame
    if (!t.nodes.empty() && t.nodes.back() == kUnknownNode) t.nodes.back() = fn.seqNr();
    t.applying += 1;
    return nullptr;
  }
  const char* name = fn.name();
  if (is_node(name)) {
    t.nodes.push_back(kUnknownNode);
    t.node_names.emplace_back(name + sizeof(kEvaluateFunction) - 1);
    return nullptr;
  }
  // A forward op reports the next sequence number until one creates the autograd node and takes it:
  // the last forward op with a number is the node's creator, and its module the node's module.
  int8_t phase = recorder().phase();
  if (fn.seqNr() >= 0 && t.nodes.empty() && phase != kBackward && phase != kOptimizer)
    recorder().note_node_module(fn.seqNr(), t.modules.empty() ? 0 : t.modules.back());
  if (is_op(name)) {
    bool seen = t.seen_frames == 0 && !is_composite(fn, recorder().backend());
    t.ops.push_back(OpFrame{name, is_helper(name), seen, seen ? recorder().allocations() : 0});
    t.seen_frames += seen;
    if (seen && recorder().programs(t)) {
      recorder().ran_op();
      if (checks_reads) note_reads(fn);
    }
  } else if (is_compiled_region(name)) {
    recorder().saw_compiled_region();
    t.ops.push_back(OpFrame{kInductor, false, false, 0});
  }
  return nullptr;
}

// Mark the storage of a tensor an op returned as an op output.
void mark_returned(const at::Tensor& t) {
  if (t.defined() && t.has_storage() && recorder().wants(t.device())) recorder().returned(storage_key(t));
}

// Mark what an op fake tensors see returned; unwinding (no outputs handed back), what it made and still holds.
void mark_outputs(const at::RecordFunction& fn, const OpFrame& frame) {
  if (std::uncaught_exceptions() > 0) {
    recorder().returned_since(frame.first);
    return;
  }
  for (const c10::IValue& value : fn.outputs()) {
    if (value.isTensor()) {
      mark_returned(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) mark_returned(t);
    }
  }
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  ThreadState& t = this_thread;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    t.applying -= 1;
    return;
  }
  const char* name = fn.name();
  if (is_node(name)) {
    if (!t.nodes.empty()) t.nodes.pop_back();
    if (!t.node_names.empty()) t.node_names.pop_back();
  } else if ((is_op(name) || is_compiled_region(name)) && !t.ops.empty()) {
    if (t.ops.back().seen) {
      t.seen_frames -= 1;
      if (marks_outputs && recorder().programs(t)) mark_outputs(fn, t.ops.back());
    }
    t.ops.pop_back();
  }
}

// What start() installed, for stop() to take away.
struct Installed {
  bool reporter = false;
  at::CallbackHandle callback = 0;
  c10::Allocator* previous_meta = nullptr;
  bool reporting_cpu = false;
};
Installed installed;

constexpr uint8_t kMetaPriority = 100;  // above the built-in meta allocator's 0
constexpr uint8_t kCPUPriority = 100;   // above the default CPU allocator's 0, as the plan allocator's

void start(const std::string& device_type, int64_t device_index, bool fake) {
  TORCH_CHECK(!recorder().active(), "the step recorder is already recording");
  c10::DeviceType type = c10::Device(device_type).type();
  recorder().start(fake ? c10::DeviceType::Meta : type, type, fake ? -1 : device_index, fake);
  this_thread = ThreadState{};
  if (fake) {
    installed.previous_meta = c10::GetAllocator(c10::DeviceType::Meta);
    c10::SetAllocator(c10::DeviceType::Meta, &meta_allocator(), kMetaPriority);
  } else {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, std::make_shared<Reporter>());
    installed.reporter = true;
    if (type == c10::DeviceType::CPU) {
      reporting_cpu_allocator().set_previous(c10::GetCPUAllocator());
      c10::SetCPUAllocator(&reporting_cpu_allocator(), kCPUPriority);
      installed.reporting_cpu = true;
    }
  }
  checks_reads = marks_outputs = !fake;
  installed.callback = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_enter, &on_exit)
          .needsIds(true)
          .needsInputs(!fake)
          .needsOutputs(!fake)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION, at::RecordScope::USER_SCOPE}));
}

void stop() {
  recorder().stop();
  if (installed.callback) at::removeCallback(installed.callback);
  if (installed.reporter) c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  if (installed.previous_meta) c10::SetAllocator(c10::DeviceType::Meta, installed.previous_meta, kMetaPriority);
  if (installed.reporting_cpu && c10::GetCPUAllocator() == &reporting_cpu_allocator())
    c10::SetCPUAllocator(reporting_cpu_allocator().previous(), kCPUPriority);
  installed = Installed{};
  this_thread = ThreadState{};
}

// Events as six parallel columns (key, size, op, module, phase, output) for the Python side.
py::tuple columns(const std::vector<Event>& events) {
  std::vector<int64_t> key, size;
  std::vector<int32_t> op, module;
  std::vector<int8_t> phase, output;
  for (const Event& e : events) {
    key.push_back(e.key);
    size.push_back(e.size);
    op.push_back(e.op);
    module.push_back(e.module);
    phase.push_back(e.phase);
    output.push_back(e.output);
  }
  return py::make_tuple(key, size, op, module, phase, output);
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
  m.def("mark", []() { recorder().mark(); }, "Mark a point of the program (a step's start or end)");
  m.def("program", []() {
    auto [events, marks, adopted] = recorder().program();
    return py::make_tuple(columns(events), marks, adopted);
  }, "The program's kept events since start as columns, the marks as indices into them, the storages adopted");
  m.def("program_tail", [](int64_t since) {
    auto [events, size] = recorder().program_tail(since);
    return py::make_tuple(columns(events), size);
  }, "The program's kept events from raw position `since` on (outside a step), and the log's length");
  m.def("phase", []() { return static_cast<int>(recorder().phase()); }, "The phase announced now");
  m.def("step_events", []() { return recorder().step_events(); },
        "Events of the step so far that the trace keeps (call between ops)");
  m.def("storage_key", &storage_key);
  m.def("storage_nbytes", [](const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); },
        "The bytes of a tensor's storage, read without making the storage a Python object (which, once made, holds "
        "a reference to it for good)");
  m.def("share_storage", [](at::Tensor& self, const at::Tensor& source, int64_t offset, std::vector<int64_t> sizes,
                            std::vector<int64_t> strides) { self.set_(source.storage(), offset, sizes, strides); },
        "self.set_(source's storage, offset, sizes, strides), the storage never made a Python object");
  m.def("accumulating", []() {
    const ThreadState& t = this_thread;
    return !t.nodes.empty() && t.applying == 0 && t.ops.size() == 1 && std::strcmp(t.ops.back().name, "aten::add") == 0;
  }, "Whether the op running is the autograd engine summing two gradients of one input (outside any node's formula)");
  m.def("caller", []() {
    const ThreadState& t = this_thread;
    if (t.ops.size() >= 2) return std::string(t.ops[t.ops.size() - 2].name);
    if (t.ops.size() == 1 && t.applying > 0 && !t.node_names.empty()) return t.node_names.back();
    return std::string();
  }, "What called the op running now: the op (a composite runs as others), or the autograd node whose formula "
     "calls it directly, or an empty string");
  m.def("references", [](const at::Tensor& t) {
    return py::make_tuple(t.use_count(), t.storage().use_count(), t.is_non_overlapping_and_dense());
  }, "References to the tensor and to its storage (the call's own included), and whether it is dense");
  m.def("outputs_marked", []() { return recorder().outputs_marked(); },
        "Whether the step's output marks hold (no torch.compile code ran, which allocates outside ops)");
  m.def("adopt", [](const at::Tensor& t) { recorder().adopt(storage_key(t), static_cast<int64_t>(t.storage().nbytes())); },
        "Count a tensor's storage, made before recording began, as alive from now on");
  m.def("in_order", [](const std::vector<StorageKey>& keys) { recorder().in_order(keys); },
        "Reorder the allocations of these storages, made in the step, among themselves to the order given");
  m.def("resized", [](const at::Tensor& t, int64_t old_nbytes) {
          recorder().resized(storage_key(t), old_nbytes, static_cast<int64_t>(t.storage().nbytes()));
        }, "A fake tensor's storage was resized in place from old_nbytes to its size now");
  m.def("unseen", []() {
    std::vector<int64_t> key, size;
    std::vector<int32_t> op, module;
    for (const auto& u : recorder().unseen()) {
      key.push_back(std::get<0>(u));
      size.push_back(std::get<1>(u));
      op.push_back(std::get<2>(u));
      module.push_back(std::get<3>(u));
    }
    return py::make_tuple(key, size, op, module);
  }, "Storages the step's ops read that the capture lacks, largest first: columns key, bytes, op, module");
  m.def("progress", []() { return recorder().progress(); },
        "Ops run, the step's events, bytes live, phase, whether the step is recording, the latest allocation's module");
  m.def("claim", [](const at::Tensor& t, bool view) {
    const ThreadState& state = this_thread;  // the op claiming runs inside another op fake tensors see?
    bool inside = state.seen_frames > 0 && !state.ops.empty() && !state.ops.back().seen;
    recorder().claim(storage_key(t), inside, view);
  }, py::arg("tensor"), py::arg("view") = false,
        "Keep the storage of this fake tensor in the capture (internal when made inside another op; a view never)");
}

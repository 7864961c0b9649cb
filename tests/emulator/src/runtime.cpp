// The CUDA runtime calls halfstep and its tests make, over host memory: allocations in a registry
// that checks every copy's direction and range, streams under an eager or a lazy model, events,
// stream capture into graphs and their replay, and one emulated device. Functions are defined
// with the signatures of cuda_runtime_api.h, so the library links against this instead of
// libcudart without a line of it changing.
//
// The lazy model runs work only when the host waits for it (a stream or event synchronisation, a
// copy to pageable memory, cudaFree, ...), and then exactly the work CUDA orders before it: the
// earlier work of the same stream, the events it waits on, and the legacy default stream's
// implicit ordering with blocking streams (non-blocking streams do not wait for it). A host read
// that CUDA does not order after a device write therefore sees the old contents.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "halfstep_emu/device.hpp"
#include "internal.hpp"

namespace halfstep_emu::internal {
namespace {

enum class MemKind : std::uint8_t { pageable, device, pinned };

const char* kind_name(MemKind k) {
  switch (k) {
    case MemKind::device: return "device memory";
    case MemKind::pinned: return "pinned host memory";
    case MemKind::pageable: return "pageable host memory";
  }
  return "memory";
}

struct Allocation {
  std::uintptr_t begin;
  std::size_t bytes;
  MemKind kind;
};

// One unit of stream work. `deps` is exactly what CUDA orders it after.
struct Op {
  std::uint64_t seq = 0;
  std::string what;
  std::function<void()> run;
  std::vector<std::shared_ptr<Op>> deps;
  bool done = false;
};
using OpPtr = std::shared_ptr<Op>;

struct Capture;
struct StreamRec {
  bool legacy = false;
  bool nonblocking = false;
  OpPtr last;
  Capture* capture = nullptr;
};

struct EventRec {
  unsigned flags = 0;
  OpPtr marker;           // completes when the recorded work completes
  bool in_capture = false;  // recorded (not as an external node) inside a capture
};

struct Node {
  std::string what;
  std::function<void()> run;
  EventRec* record = nullptr;  // an external event record node
};
struct GraphRec {
  std::vector<Node> nodes;
};
struct GraphExecRec {
  std::vector<Node> nodes;
};

struct Capture {
  StreamRec* stream = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  GraphRec* graph = nullptr;
  bool invalidated = false;
};

struct Runtime {
  std::recursive_mutex mutex;
  std::map<std::uintptr_t, Allocation> allocations;
  std::size_t device_bytes = 0;
  StreamRec legacy;
  StreamRec per_thread;
  std::set<StreamRec*> streams;
  std::set<EventRec*> events;
  std::set<GraphRec*> graphs;
  std::set<GraphExecRec*> execs;
  std::deque<OpPtr> pending;
  std::uint64_t next_seq = 0;
  std::vector<Capture*> captures;
  cudaError_t sticky = cudaSuccess;
  std::string sticky_message;
  cudaError_t last_error = cudaSuccess;
  cudaError_t detail_code = cudaSuccess;
  std::string detail;
  std::string error_text;  // what cudaGetErrorString returned last
  bool settings_loaded = false;
  Settings settings;
  Counters counters;
  std::uint64_t schedule_index = 0;
  Runtime() { legacy.legacy = true; }
};

// Deliberately never destroyed: test fixtures may free device memory during static destruction.
Runtime& rt() {
  static Runtime* r = new Runtime;
  return *r;
}

using Lock = std::lock_guard<std::recursive_mutex>;

std::uint64_t g_generation = 0;  // changes whenever an allocation goes away

std::string ptr_str(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

cudaError_t fail(cudaError_t code, const std::string& detail) {
  Runtime& r = rt();
  r.last_error = code;
  r.detail_code = code;
  r.detail = detail;
  print(detail);
  return code;
}

// The registry entry containing address a, or null.
const Allocation* find(std::uintptr_t a) {
  auto& m = rt().allocations;
  auto it = m.upper_bound(a);
  if (it == m.begin()) return nullptr;
  --it;
  const Allocation& al = it->second;
  return a < al.begin + al.bytes ? &al : nullptr;
}

// What kind of memory [p, p + n) is, checking that it stays inside one allocation.
cudaError_t classify(const char* call, const char* which, const void* p, std::size_t n,
                     MemKind& out) {
  out = MemKind::pageable;
  if (n == 0) return cudaSuccess;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (p == nullptr) return fail(cudaErrorInvalidValue, std::string(call) + ": " + which + " is null");
  if (const Allocation* al = find(a)) {
    out = al->kind;
    if (a + n > al->begin + al->bytes) {
      return fail(cudaErrorInvalidValue,
                  std::string(call) + ": " + which + " [" + ptr_str(p) + ", +" + std::to_string(n) +
                      ") runs " + std::to_string(a + n - al->begin - al->bytes) +
                      " bytes past the end of its " + kind_name(al->kind) + " allocation of " +
                      std::to_string(al->bytes) + " bytes");
    }
    return cudaSuccess;
  }
  auto& m = rt().allocations;
  auto next = m.upper_bound(a);
  if (next != m.end() && next->first < a + n) {
    return fail(cudaErrorInvalidValue, std::string(call) + ": " + which + " [" + ptr_str(p) + ", +" +
                                           std::to_string(n) + ") runs into " +
                                           kind_name(next->second.kind) + " at " +
                                           ptr_str(reinterpret_cast<void*>(next->first)));
  }
  return cudaSuccess;
}

const char* memcpy_kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToHost: return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice: return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost: return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice: return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault: return "cudaMemcpyDefault";
  }
  return "an unknown cudaMemcpyKind";
}

// The direction a copy claims must be the direction it has.
cudaError_t check_direction(const char* call, cudaMemcpyKind kind, MemKind dst, MemKind src) {
  bool dst_device = dst == MemKind::device, src_device = src == MemKind::device;
  bool want_dst_device = false, want_src_device = false;
  switch (kind) {
    case cudaMemcpyHostToHost: break;
    case cudaMemcpyHostToDevice: want_dst_device = true; break;
    case cudaMemcpyDeviceToHost: want_src_device = true; break;
    case cudaMemcpyDeviceToDevice: want_dst_device = want_src_device = true; break;
    case cudaMemcpyDefault: return cudaSuccess;
    default:
      return fail(cudaErrorInvalidMemcpyDirection,
                  std::string(call) + ": unknown cudaMemcpyKind " + std::to_string(static_cast<int>(kind)));
  }
  if (dst_device != want_dst_device) {
    return fail(cudaErrorInvalidValue, std::string(call) + "(" + memcpy_kind_name(kind) + "): dst is " +
                                           kind_name(dst) + ", not " +
                                           (want_dst_device ? "device memory" : "host memory"));
  }
  if (src_device != want_src_device) {
    return fail(cudaErrorInvalidValue, std::string(call) + "(" + memcpy_kind_name(kind) + "): src is " +
                                           kind_name(src) + ", not " +
                                           (want_src_device ? "device memory" : "host memory"));
  }
  return cudaSuccess;
}

bool lazy() { return settings().streams == StreamModel::lazy; }

// Runs `target` after everything it depends on (depth first, dependencies in a fixed order).
void run_until(const OpPtr& target) {
  if (!target || target->done) return;
  std::vector<Op*> stack{target.get()};
  while (!stack.empty()) {
    Op* o = stack.back();
    if (o->done) {
      stack.pop_back();
      continue;
    }
    bool ready = true;
    for (const OpPtr& d : o->deps) {
      if (!d->done) {
        stack.push_back(d.get());
        ready = false;
      }
    }
    if (!ready) continue;
    stack.pop_back();
    o->done = true;
    if (rt().sticky == cudaSuccess && o->run) o->run();
    o->run = nullptr;
    o->deps.clear();
  }
}

void run_all() {
  Runtime& r = rt();
  while (!r.pending.empty()) {
    const OpPtr op = r.pending.front();
    r.pending.pop_front();
    run_until(op);
  }
}

StreamRec* stream_of(cudaStream_t s) {
  Runtime& r = rt();
  if (s == nullptr || s == cudaStreamLegacy) return &r.legacy;
  if (s == cudaStreamPerThread) return &r.per_thread;
  auto* rec = reinterpret_cast<StreamRec*>(s);
  return r.streams.count(rec) ? rec : nullptr;
}

EventRec* event_of(cudaEvent_t e) {
  auto* rec = reinterpret_cast<EventRec*>(e);
  return rt().events.count(rec) ? rec : nullptr;
}

void invalidate(Capture* c) { c->invalidated = true; }

// A call CUDA forbids while a capture in global or thread-local mode is under way (everything
// that would synchronise or allocate synchronously): the captures are invalidated.
cudaError_t forbidden_during_capture(const char* call) {
  Runtime& r = rt();
  bool any = false;
  for (Capture* c : r.captures) {
    if (c->mode != cudaStreamCaptureModeRelaxed) {
      invalidate(c);
      any = true;
    }
  }
  if (!any) return cudaSuccess;
  return fail(cudaErrorStreamCaptureUnsupported,
              std::string(call) + " is not allowed while a stream is being captured (the capture is invalidated)");
}

// Appends work to stream `s`: into its capture, or as an op ordered after what CUDA orders it after.
cudaError_t enqueue(StreamRec& s, std::string what, std::function<void()> fn,
                    const OpPtr& also_after = nullptr, EventRec* records = nullptr,
                    OpPtr* out = nullptr) {
  Runtime& r = rt();
  if (s.capture != nullptr) {
    if (also_after) {
      return fail(cudaErrorStreamCaptureUnsupported,
                  "waiting on an event recorded outside the capture is not emulated");
    }
    s.capture->graph->nodes.push_back(Node{std::move(what), std::move(fn), records});
    return cudaSuccess;
  }
  if (s.legacy) {
    for (Capture* c : r.captures) {
      if (!c->stream->nonblocking) {
        invalidate(c);
        return fail(cudaErrorStreamCaptureImplicit,
                    what + " on the legacy default stream would depend on a blocking stream that is being captured");
      }
    }
  }
  auto op = std::make_shared<Op>();
  op->seq = r.next_seq++;
  op->what = std::move(what);
  op->run = std::move(fn);
  auto after = [&op](const OpPtr& d) {
    if (d && !d->done) op->deps.push_back(d);
  };
  after(s.last);
  after(also_after);
  if (s.legacy) {  // the legacy stream waits for all blocking streams
    after(r.per_thread.last);
    for (StreamRec* x : r.streams) {
      if (!x->nonblocking) after(x->last);
    }
  } else if (!s.nonblocking) {  // blocking streams wait for the legacy stream
    after(r.legacy.last);
  }
  s.last = op;
  if (records) records->marker = op;
  if (out) *out = op;
  if (lazy()) {
    while (!r.pending.empty() && r.pending.front()->done) r.pending.pop_front();
    r.pending.push_back(op);
  } else {
    run_until(op);
  }
  return cudaSuccess;
}

cudaError_t status() { return rt().sticky; }

// A byte copy as a stream op; `snapshot` copies the source now (pageable host staging).
std::function<void()> copy_fn(void* dst, const void* src, std::size_t n, bool snapshot) {
  if (snapshot) {
    auto staged = std::make_shared<std::vector<unsigned char>>(
        static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + n);
    return [dst, staged] {
      if (!staged->empty()) std::memcpy(dst, staged->data(), staged->size());
    };
  }
  return [dst, src, n] {
    if (n) std::memmove(dst, src, n);
  };
}

cudaError_t do_memcpy(const char* call, void* dst, const void* src, std::size_t n,
                      cudaMemcpyKind kind, StreamRec& s, bool async) {
  if (n == 0) return status();
  MemKind dk, sk;
  if (cudaError_t e = classify(call, "dst", dst, n, dk)) return e;
  if (cudaError_t e = classify(call, "src", src, n, sk)) return e;
  if (cudaError_t e = check_direction(call, kind, dk, sk)) return e;
  const bool dst_host = dk != MemKind::device, src_host = sk != MemKind::device;
  const std::string what = std::string(call) + " of " + std::to_string(n) + " bytes";
  if (s.capture != nullptr && (dk == MemKind::pageable || sk == MemKind::pageable) && n > 0) {
    invalidate(s.capture);
    return fail(cudaErrorStreamCaptureUnsupported,
                std::string(call) + " with pageable host memory cannot be captured");
  }
  if (!async && s.capture == nullptr) {
    if (cudaError_t e = forbidden_during_capture(call)) return e;
  }
  if (dst_host && src_host) {  // host to host: fully synchronous
    run_until(s.last);
    if (n) std::memmove(dst, src, n);
    return status();
  }
  if (src_host && !dst_host) {  // to the device
    if (sk == MemKind::pageable) {
      if (!async) run_until(s.last);  // a synchronous copy from pageable memory syncs first,
      return enqueue(s, what, copy_fn(dst, src, n, true));  // stages, and may land later
    }
    OpPtr op;
    if (cudaError_t e = enqueue(s, what, copy_fn(dst, src, n, false), nullptr, nullptr, &op)) return e;
    if (!async) run_until(op);  // from pinned memory: synchronous
    return status();
  }
  if (!src_host && dst_host) {  // to the host
    OpPtr op;
    if (cudaError_t e = enqueue(s, what, copy_fn(dst, src, n, false), nullptr, nullptr, &op)) return e;
    if (!async || dk == MemKind::pageable) run_until(op);  // pageable destinations: synchronous
    return status();
  }
  return enqueue(s, what, copy_fn(dst, src, n, false));  // device to device: no host wait
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    default: return nullptr;
  }
}

const char* error_text(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    default: return "unknown error";
  }
}

std::size_t parse_size(const std::string& v) {
  std::size_t pos = 0;
  const unsigned long long n = std::stoull(v, &pos);
  std::size_t mult = 1;
  const std::string unit = v.substr(pos);
  if (unit == "K") mult = std::size_t{1} << 10;
  else if (unit == "M") mult = std::size_t{1} << 20;
  else if (unit == "G") mult = std::size_t{1} << 30;
  else if (!unit.empty()) throw std::invalid_argument("memory=" + v + ": the unit must be K, M or G");
  return static_cast<std::size_t>(n) * mult;
}

void print_counters() {
  const Counters& c = rt().counters;
  std::fprintf(stderr,
               "halfstep emulator [%s]: %llu launches, %llu blocks, %llu threads, %llu switches, "
               "%llu barriers, %llu warp operations, %llu faults, %llu bytes read, %llu written\n",
               format_settings(rt().settings).c_str(), static_cast<unsigned long long>(c.launches),
               static_cast<unsigned long long>(c.blocks), static_cast<unsigned long long>(c.threads),
               static_cast<unsigned long long>(c.switches), static_cast<unsigned long long>(c.barriers),
               static_cast<unsigned long long>(c.warp_ops), static_cast<unsigned long long>(c.faults),
               static_cast<unsigned long long>(c.bytes_read), static_cast<unsigned long long>(c.bytes_written));
}

}  // namespace

Settings parse_settings(const std::string& spec) {
  Settings s;
  std::stringstream in(spec);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("'" + item + "' is not key=value");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    auto bad = [&](const char* allowed) {
      return std::invalid_argument(k + "=" + v + ": allowed values are " + allowed);
    };
    if (k == "threads") {
      if (v == "forward") s.threads = ThreadOrder::forward;
      else if (v == "reverse") s.threads = ThreadOrder::reverse;
      else if (v == "random") s.threads = ThreadOrder::random;
      else if (v == "warps") s.threads = ThreadOrder::warps;
      else if (v == "starve") s.threads = ThreadOrder::starve;
      else throw bad("forward, reverse, random, warps, starve");
    } else if (k == "blocks") {
      if (v == "forward") s.blocks = BlockOrder::forward;
      else if (v == "reverse") s.blocks = BlockOrder::reverse;
      else if (v == "random") s.blocks = BlockOrder::random;
      else throw bad("forward, reverse, random");
    } else if (k == "shared") {
      if (v == "nan") s.shared = SharedFill::nan;
      else if (v == "random") s.shared = SharedFill::random;
      else if (v == "zero") s.shared = SharedFill::zero;
      else throw bad("nan, random, zero");
    } else if (k == "streams") {
      if (v == "eager") s.streams = StreamModel::eager;
      else if (v == "lazy") s.streams = StreamModel::lazy;
      else throw bad("eager, lazy");
    } else if (k == "seed") {
      s.seed = std::stoull(v);
    } else if (k == "memory") {
      s.memory = parse_size(v);
    } else if (k == "faults") {
      if (v == "report") s.abort_on_fault = false;
      else if (v == "abort") s.abort_on_fault = true;
      else throw bad("report, abort");
    } else if (k == "report") {
      if (v == "0" || v == "1") s.report = v == "1";
      else throw bad("0, 1");
    } else {
      throw std::invalid_argument("unknown key '" + k +
                                  "' (keys: threads, blocks, seed, shared, streams, memory, faults, report)");
    }
  }
  return s;
}

std::string format_settings(const Settings& s) {
  static const char* threads[] = {"forward", "reverse", "random", "warps", "starve"};
  static const char* blocks[] = {"forward", "reverse", "random"};
  static const char* shared[] = {"nan", "random", "zero"};
  std::ostringstream out;
  out << "threads=" << threads[static_cast<int>(s.threads)]
      << ",blocks=" << blocks[static_cast<int>(s.blocks)] << ",seed=" << s.seed
      << ",shared=" << shared[static_cast<int>(s.shared)]
      << ",streams=" << (s.streams == StreamModel::lazy ? "lazy" : "eager");
  return out.str();
}

const Settings& settings() {
  Runtime& r = rt();
  if (!r.settings_loaded) {
    r.settings_loaded = true;
    const char* env = std::getenv("HALFSTEP_EMU");
    try {
      r.settings = parse_settings(env ? env : "");
    } catch (const std::exception& e) {
      fatal(std::string("HALFSTEP_EMU: ") + e.what());
    }
    if (r.settings.report) std::atexit(print_counters);
  }
  return r.settings;
}

Counters& mutable_counters() { return rt().counters; }

std::uint64_t next_schedule_index() { return rt().schedule_index++; }

void set_sticky_fault(cudaError_t code, const std::string& message) {
  Runtime& r = rt();
  if (r.sticky == cudaSuccess) {
    r.sticky = code;
    r.sticky_message = message;
  }
  r.last_error = code;
  print("FAULT " + std::string(error_name(code) ? error_name(code) : "?") + ": " + message);
  if (settings().abort_on_fault) std::abort();
}

bool in_device_memory(const void* p, std::size_t bytes) {
  // Kernels run inside runtime calls that hold the lock; no second lock here.
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  static thread_local Allocation cached{0, 0, MemKind::pageable};
  static thread_local std::uint64_t cached_generation = ~std::uint64_t{0};
  if (cached_generation == g_generation && a >= cached.begin && a + bytes <= cached.begin + cached.bytes) {
    return true;
  }
  const Allocation* al = find(a);
  if (al == nullptr || al->kind != MemKind::device || a + bytes > al->begin + al->bytes) return false;
  cached = *al;
  cached_generation = g_generation;
  return true;
}

void print(const std::string& message) {
  std::fprintf(stderr, "halfstep emulator: %s\n", message.c_str());
}

void fatal(const std::string& message) {
  std::fprintf(stderr, "halfstep emulator: fatal: %s\n", message.c_str());
  std::abort();
}

}  // namespace halfstep_emu::internal

namespace halfstep_emu {

using namespace internal;

void enqueue_kernel(const char* name, dim3 grid, dim3 block, std::size_t shared_bytes,
                    cudaStream_t stream, std::function<void()> body) {
  Lock lock(rt().mutex);
  Runtime& r = rt();
  if (r.sticky != cudaSuccess) {
    r.last_error = r.sticky;
    return;
  }
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7FFFFFFFu || grid.y > 65535 ||
      grid.z > 65535 || threads == 0 || threads > 1024 || block.z > 64 || shared_bytes > 48 * 1024) {
    fail(cudaErrorInvalidConfiguration,
         std::string("launch of ") + name + " with grid (" + std::to_string(grid.x) + "," +
             std::to_string(grid.y) + "," + std::to_string(grid.z) + "), block (" +
             std::to_string(block.x) + "," + std::to_string(block.y) + "," + std::to_string(block.z) +
             "), " + std::to_string(shared_bytes) + " bytes of dynamic shared memory");
    return;
  }
  if (shared_bytes != 0) {
    fail(cudaErrorNotSupported, std::string("launch of ") + name + ": dynamic shared memory is not emulated");
    return;
  }
  StreamRec* s = stream_of(stream);
  if (s == nullptr) {
    fail(cudaErrorInvalidResourceHandle, std::string("launch of ") + name + " on an unknown stream");
    return;
  }
  auto shared_body = std::make_shared<std::function<void()>>(std::move(body));
  enqueue(*s, std::string("kernel ") + name, [name, grid, block, shared_body] {
    run_grid(name, grid, block, *shared_body);
  });
}

void configure(const std::string& spec) {
  Lock lock(rt().mutex);
  run_all();
  Runtime& r = rt();
  (void)internal::settings();  // load the environment first, so it cannot override this later
  r.settings = parse_settings(spec);
  r.schedule_index = 0;
}

std::string settings() {
  Lock lock(rt().mutex);
  return format_settings(internal::settings());
}

cudaError_t fault_code() { return rt().sticky; }
std::string fault_message() { return rt().sticky_message; }

void clear_fault() {
  Lock lock(rt().mutex);
  Runtime& r = rt();
  for (const OpPtr& op : r.pending) {
    op->done = true;
    op->run = nullptr;
    op->deps.clear();
  }
  r.pending.clear();
  r.sticky = cudaSuccess;
  r.sticky_message.clear();
  r.last_error = cudaSuccess;
}

Counters counters() { return rt().counters; }

}  // namespace halfstep_emu

// --- the runtime API ------------------------------------------------------------------------------
using namespace halfstep_emu::internal;

#define EMU_LOCK Lock lock_(rt().mutex)
#define EMU_ENTRY                          \
  EMU_LOCK;                                \
  if (rt().sticky != cudaSuccess) {        \
    rt().last_error = rt().sticky;         \
    return rt().sticky;                    \
  }

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  EMU_ENTRY;
  if (!count) return fail(cudaErrorInvalidValue, "cudaGetDeviceCount: count is null");
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  EMU_ENTRY;
  if (!device) return fail(cudaErrorInvalidValue, "cudaGetDevice: device is null");
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  EMU_ENTRY;
  if (device != 0) return fail(cudaErrorInvalidDevice, "cudaSetDevice: the emulated device is device 0");
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  EMU_ENTRY;
  if (!prop) return fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: prop is null");
  if (device != 0) return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: no device " + std::to_string(device));
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "halfstep emulated device (CPU)");
  prop->totalGlobalMem = settings().memory;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7FFFFFFF;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->unifiedAddressing = 1;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  EMU_ENTRY;
  if (!free_bytes || !total) return fail(cudaErrorInvalidValue, "cudaMemGetInfo: null output");
  *total = settings().memory;
  *free_bytes = *total > rt().device_bytes ? *total - rt().device_bytes : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  EMU_ENTRY;
  if (cudaError_t e = forbidden_during_capture("cudaDeviceSynchronize")) return e;
  run_all();
  return status();
}

cudaError_t cudaGetLastError(void) {
  EMU_LOCK;
  Runtime& r = rt();
  if (r.sticky != cudaSuccess) return r.sticky;
  const cudaError_t e = r.last_error;
  r.last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  EMU_LOCK;
  return rt().sticky != cudaSuccess ? rt().sticky : rt().last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  const char* n = error_name(error);
  return n ? n : "cudaErrorUnknown";
}

// The text of `error`; when it is the error of the last failed call or of a kernel fault, the
// emulator's message follows (valid until the next call).
const char* cudaGetErrorString(cudaError_t error) {
  EMU_LOCK;
  Runtime& r = rt();
  std::string text = error_text(error);
  if (error != cudaSuccess && error == r.sticky) {
    text += " (emulated device: " + r.sticky_message + ")";
  } else if (error != cudaSuccess && error == r.detail_code) {
    text += " (emulated device: " + r.detail + ")";
  }
  r.error_text = text;
  return r.error_text.c_str();
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  EMU_ENTRY;
  if (!ptr) return fail(cudaErrorInvalidValue, "cudaMalloc: ptr is null");
  if (cudaError_t e = forbidden_during_capture("cudaMalloc")) return e;
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  Runtime& r = rt();
  if (size > settings().memory - std::min(settings().memory, r.device_bytes)) {
    return fail(cudaErrorMemoryAllocation, "cudaMalloc of " + std::to_string(size) +
                                               " bytes: the emulated device has " +
                                               std::to_string(settings().memory - r.device_bytes) + " bytes free");
  }
  void* p = nullptr;
  if (posix_memalign(&p, 256, size) != 0) {
    return fail(cudaErrorMemoryAllocation, "cudaMalloc of " + std::to_string(size) + " bytes: host allocation failed");
  }
  std::memset(p, 0xFF, size);  // fresh device memory holds NaN bytes, not zeros
  r.allocations[reinterpret_cast<std::uintptr_t>(p)] = Allocation{reinterpret_cast<std::uintptr_t>(p), size, MemKind::device};
  r.device_bytes += size;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  EMU_ENTRY;
  if (!ptr) return fail(cudaErrorInvalidValue, "cudaMallocHost: ptr is null");
  if (cudaError_t e = forbidden_during_capture("cudaMallocHost")) return e;
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  void* p = nullptr;
  if (posix_memalign(&p, 256, size) != 0) {
    return fail(cudaErrorMemoryAllocation, "cudaMallocHost of " + std::to_string(size) + " bytes failed");
  }
  std::memset(p, 0xFF, size);
  rt().allocations[reinterpret_cast<std::uintptr_t>(p)] = Allocation{reinterpret_cast<std::uintptr_t>(p), size, MemKind::pinned};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) { return cudaMallocHost(ptr, size); }

namespace {
cudaError_t release(void* ptr, MemKind kind, const char* call) {
  if (ptr == nullptr) return cudaSuccess;
  Runtime& r = rt();
  auto it = r.allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == r.allocations.end() || it->second.kind != kind) {
    return fail(cudaErrorInvalidValue, std::string(call) + "(" + ptr_str(ptr) + "): not the start of " +
                                           kind_name(kind) + " from " +
                                           (kind == MemKind::device ? "cudaMalloc" : "cudaMallocHost"));
  }
  if (r.sticky == cudaSuccess) {
    if (cudaError_t e = forbidden_during_capture(call)) return e;
    run_all();  // freeing synchronises: pending work may still use the memory
  }
  if (kind == MemKind::device) r.device_bytes -= it->second.bytes;
  r.allocations.erase(it);
  ++g_generation;
  std::free(ptr);
  return r.sticky;
}
}  // namespace

cudaError_t cudaFree(void* ptr) {
  EMU_LOCK;  // memory is released even after a fault, so tests do not leak
  return release(ptr, MemKind::device, "cudaFree");
}

cudaError_t cudaFreeHost(void* ptr) {
  EMU_LOCK;
  return release(ptr, MemKind::pinned, "cudaFreeHost");
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) {
  EMU_ENTRY;
  if (!attr) return fail(cudaErrorInvalidValue, "cudaPointerGetAttributes: attributes is null");
  std::memset(attr, 0, sizeof *attr);
  const Allocation* al = find(reinterpret_cast<std::uintptr_t>(ptr));
  if (al == nullptr) {
    attr->type = cudaMemoryTypeUnregistered;
    attr->device = -2;
    return cudaSuccess;
  }
  attr->device = 0;
  attr->devicePointer = const_cast<void*>(ptr);
  if (al->kind == MemKind::device) {
    attr->type = cudaMemoryTypeDevice;
  } else {
    attr->type = cudaMemoryTypeHost;
    attr->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  EMU_ENTRY;
  return do_memcpy("cudaMemcpy", dst, src, count, kind, rt().legacy, false);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: unknown stream");
  return do_memcpy("cudaMemcpyAsync", dst, src, count, kind, *s, true);
}

namespace {
cudaError_t do_memset(const char* call, void* p, int value, size_t count, StreamRec& s) {
  MemKind k;
  if (cudaError_t e = classify(call, "devPtr", p, count, k)) return e;
  if (count > 0 && k != MemKind::device) {
    return fail(cudaErrorInvalidValue, std::string(call) + ": " + ptr_str(p) + " is " + kind_name(k) + ", not device memory");
  }
  return enqueue(s, std::string(call) + " of " + std::to_string(count) + " bytes", [p, value, count] {
    if (count) std::memset(p, value, count);
  });
}
}  // namespace

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  EMU_ENTRY;
  if (cudaError_t e = forbidden_during_capture("cudaMemset")) return e;
  return do_memset("cudaMemset", ptr, value, count, rt().legacy);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: unknown stream");
  return do_memset("cudaMemsetAsync", ptr, value, count, *s);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  EMU_ENTRY;
  if (!stream) return fail(cudaErrorInvalidValue, "cudaStreamCreate: stream is null");
  auto* s = new StreamRec;
  s->nonblocking = (flags & cudaStreamNonBlocking) != 0;
  rt().streams.insert(s);
  *stream = reinterpret_cast<cudaStream_t>(s);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  EMU_LOCK;
  Runtime& r = rt();
  StreamRec* s = stream_of(stream);
  if (!s || s->legacy || s == &r.per_thread) {
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a stream from cudaStreamCreate");
  }
  if (s->capture) return fail(cudaErrorIllegalState, "cudaStreamDestroy: the stream is being captured");
  r.streams.erase(s);  // its pending work still runs: the ops stay referenced elsewhere
  delete s;
  return r.sticky;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: unknown stream");
  if (s->capture) {
    invalidate(s->capture);
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize on a stream that is being captured");
  }
  if (cudaError_t e = forbidden_during_capture("cudaStreamSynchronize")) return e;
  run_until(s->last);
  return status();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery: unknown stream");
  return !s->last || s->last->done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  EventRec* e = event_of(event);
  if (!s || !e) return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown stream or event");
  if (e->in_capture) {
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamWaitEvent: joining a capture from another stream is not emulated");
  }
  if (!e->marker || e->marker->done) return cudaSuccess;
  return enqueue(*s, "wait for an event", nullptr, e->marker);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* st) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  if (!s || !st) return fail(cudaErrorInvalidValue, "cudaStreamIsCapturing: unknown stream or null status");
  *st = !s->capture ? cudaStreamCaptureStatusNone
                    : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                              : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  EMU_ENTRY;
  StreamRec* s = stream_of(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle, "cudaStreamBeginCapture: unknown stream");
  if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture: the legacy stream cannot be captured");
  if (s->capture) return fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
  auto* c = new Capture;
  c->stream = s;
  c->mode = mode;
  c->graph = new GraphRec;
  s->capture = c;
  rt().captures.push_back(c);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  EMU_LOCK;
  Runtime& r = rt();
  StreamRec* s = stream_of(stream);
  if (!s || !s->capture) return fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
  if (!graph) return fail(cudaErrorInvalidValue, "cudaStreamEndCapture: graph is null");
  Capture* c = s->capture;
  s->capture = nullptr;
  r.captures.erase(std::find(r.captures.begin(), r.captures.end(), c));
  const bool invalid = c->invalidated;
  if (invalid) {
    delete c->graph;
    *graph = nullptr;
  } else {
    r.graphs.insert(c->graph);
    *graph = reinterpret_cast<cudaGraph_t>(c->graph);
  }
  delete c;
  if (r.sticky != cudaSuccess) return r.sticky;
  return invalid ? fail(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture: the capture was invalidated")
                 : cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  EMU_ENTRY;
  auto* g = reinterpret_cast<GraphRec*>(graph);
  if (!exec || !rt().graphs.count(g)) return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: unknown graph");
  auto* x = new GraphExecRec{g->nodes};
  rt().execs.insert(x);
  *exec = reinterpret_cast<cudaGraphExec_t>(x);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  EMU_ENTRY;
  auto* x = reinterpret_cast<GraphExecRec*>(exec);
  StreamRec* s = stream_of(stream);
  if (!rt().execs.count(x) || !s) return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: unknown graph or stream");
  for (const Node& n : x->nodes) {
    if (n.record && !rt().events.count(n.record)) {
      return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: the graph records an event that was destroyed");
    }
  }
  for (const Node& n : x->nodes) {
    if (cudaError_t e = enqueue(*s, "graph node: " + n.what, n.run, nullptr, n.record)) return e;
  }
  return status();
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  EMU_LOCK;
  auto* x = reinterpret_cast<GraphExecRec*>(exec);
  if (!rt().execs.erase(x)) return fail(cudaErrorInvalidValue, "cudaGraphExecDestroy: unknown graph exec");
  delete x;
  return rt().sticky;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  EMU_LOCK;
  auto* g = reinterpret_cast<GraphRec*>(graph);
  if (!rt().graphs.erase(g)) return fail(cudaErrorInvalidValue, "cudaGraphDestroy: unknown graph");
  delete g;
  return rt().sticky;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  EMU_ENTRY;
  if (!event) return fail(cudaErrorInvalidValue, "cudaEventCreate: event is null");
  auto* e = new EventRec;
  e->flags = flags;
  rt().events.insert(e);
  *event = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  EMU_LOCK;
  EventRec* e = event_of(event);
  if (!e) return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: unknown event");
  rt().events.erase(e);
  delete e;
  return rt().sticky;
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  EMU_ENTRY;
  EventRec* e = event_of(event);
  StreamRec* s = stream_of(stream);
  if (!e || !s) return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown event or stream");
  if (s->capture && !(flags & cudaEventRecordExternal)) {  // a capture-internal event
    e->in_capture = true;
    e->marker = nullptr;
    return cudaSuccess;
  }
  e->in_capture = false;
  return enqueue(*s, "event record", [] {}, nullptr, e);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return cudaEventRecordWithFlags(event, stream, 0);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  EMU_ENTRY;
  EventRec* e = event_of(event);
  if (!e) return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: unknown event");
  if (e->in_capture) return fail(cudaErrorCapturedEvent, "cudaEventSynchronize: the event was recorded inside a capture");
  if (cudaError_t err = forbidden_during_capture("cudaEventSynchronize")) return err;
  run_until(e->marker);
  return status();
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  EMU_ENTRY;
  EventRec* e = event_of(event);
  if (!e) return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: unknown event");
  if (e->in_capture) return fail(cudaErrorCapturedEvent, "cudaEventQuery: the event was recorded inside a capture");
  return !e->marker || e->marker->done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaDriverGetVersion(int* v) {
  EMU_ENTRY;
  if (!v) return fail(cudaErrorInvalidValue, "cudaDriverGetVersion: null");
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  EMU_ENTRY;
  if (!v) return fail(cudaErrorInvalidValue, "cudaRuntimeGetVersion: null");
  *v = CUDART_VERSION;
  return cudaSuccess;
}

}  // extern "C"

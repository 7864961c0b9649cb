// The emulated device's NCCL: the part of NCCL's C API halfstep and its tests use, for ranks that
// are host threads of one process sharing the emulated device. The emulated libhalfstep links
// this instead of libnccl, so the library's own NCCL code (src/distributed.cpp) runs in CI.
//
// Semantics kept from NCCL: communicators are created collectively (ncclCommInitRank blocks until
// every rank has joined); a collective is matched across ranks by order of issue; operations
// between ncclGroupStart and ncclGroupEnd run at ncclGroupEnd; buffers must be device memory;
// reductions are elementwise over the ranks' buffers (16-bit floats in fp32, rounded once), in
// place or not; a collective is ordered after the work enqueued before it on its stream, and the
// work enqueued after it sees its result.
// What differs: a collective runs synchronously on the calling thread (after waiting for its
// stream), so it cannot be captured in a CUDA graph (ncclInvalidUsage), and one thread cannot
// drive several ranks of one communicator. A rank that waits more than 60 s for the others
// fails with ncclSystemError instead of hanging.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr auto kPatience = std::chrono::seconds(60);

thread_local std::string t_last_error;

ncclResult_t fail(ncclResult_t code, const std::string& message) {
  t_last_error = message;
  return code;
}

enum class Kind : std::uint8_t { all_reduce, reduce_scatter, all_gather };

// One rank's part of a collective.
struct Call {
  Kind kind;
  const void* send;
  void* recv;
  std::size_t count;  // elements each rank receives (all_reduce: the buffer; reduce_scatter: its
                      // share; all_gather: what each rank sends)
  ncclDataType_t type;
  ncclRedOp_t op;
  cudaStream_t stream;
};

// The ranks of one communicator: a barrier that also combines their calls.
struct Group {
  explicit Group(int n) : nranks(n), calls(static_cast<std::size_t>(n)) {}
  const int nranks;
  std::mutex mutex;
  std::condition_variable changed;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<Call> calls;
  std::vector<unsigned char> result;  // the reduced or gathered data of the last collective
  ncclResult_t status = ncclSuccess;
  std::string message;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<Group> group;
  int rank = 0;
  int device = 0;
};

namespace {

// Communicators being created, by unique id.
struct Pending {
  int nranks = 0;
  int joined = 0;
  std::vector<bool> taken;
  std::shared_ptr<Group> group;
};
std::mutex g_pending_mutex;
std::condition_variable g_pending_changed;
std::map<std::string, Pending> g_pending;

std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

template <class T>
void reduce_into(T* acc, const T* x, std::size_t n, ncclRedOp_t op) {
  for (std::size_t i = 0; i < n; ++i) {
    switch (op) {
      case ncclSum: acc[i] = static_cast<T>(acc[i] + x[i]); break;
      case ncclProd: acc[i] = static_cast<T>(acc[i] * x[i]); break;
      case ncclMax: acc[i] = acc[i] < x[i] ? x[i] : acc[i]; break;
      case ncclMin: acc[i] = x[i] < acc[i] ? x[i] : acc[i]; break;
      case ncclAvg: acc[i] = static_cast<T>(acc[i] + x[i]); break;  // divided after the last rank
      default: break;
    }
  }
}

void reduce_typed(void* acc, const void* x, std::size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: reduce_into(static_cast<std::int8_t*>(acc), static_cast<const std::int8_t*>(x), n, op); break;
    case ncclUint8: reduce_into(static_cast<std::uint8_t*>(acc), static_cast<const std::uint8_t*>(x), n, op); break;
    case ncclInt32: reduce_into(static_cast<std::int32_t*>(acc), static_cast<const std::int32_t*>(x), n, op); break;
    case ncclUint32: reduce_into(static_cast<std::uint32_t*>(acc), static_cast<const std::uint32_t*>(x), n, op); break;
    case ncclInt64: reduce_into(static_cast<std::int64_t*>(acc), static_cast<const std::int64_t*>(x), n, op); break;
    case ncclUint64: reduce_into(static_cast<std::uint64_t*>(acc), static_cast<const std::uint64_t*>(x), n, op); break;
    case ncclFloat32: reduce_into(static_cast<float*>(acc), static_cast<const float*>(x), n, op); break;
    case ncclFloat64: reduce_into(static_cast<double*>(acc), static_cast<const double*>(x), n, op); break;
    default: break;
  }
}

// 16-bit floats are reduced in fp32 and rounded once to nearest even at the end.
float widen(ncclDataType_t t, std::uint16_t bits) {
  return t == ncclFloat16 ? __half2float(__ushort_as_half(bits))
                          : __bfloat162float(__ushort_as_bfloat16(bits));
}
std::uint16_t narrow(ncclDataType_t t, float x) {
  return t == ncclFloat16 ? __half_as_ushort(__float2half_rn(x)) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Fills g.result from every rank's call (the last rank to arrive does this, under the lock).
void combine_calls(Group& g) {
  const Call& first = g.calls[0];
  for (int r = 1; r < g.nranks; ++r) {
    const Call& c = g.calls[static_cast<std::size_t>(r)];
    if (c.kind != first.kind || c.count != first.count || c.type != first.type ||
        (first.kind != Kind::all_gather && c.op != first.op)) {
      g.status = ncclInvalidUsage;
      g.message = "ranks 0 and " + std::to_string(r) + " issued different collectives (kind, count, type or op)";
      return;
    }
  }
  const std::size_t size = type_size(first.type);
  const std::size_t n = static_cast<std::size_t>(g.nranks);
  switch (first.kind) {
    case Kind::all_reduce:
    case Kind::reduce_scatter: {
      const std::size_t total = first.kind == Kind::all_reduce ? first.count : first.count * n;
      if (first.type == ncclFloat16 || first.type == ncclBfloat16) {
        std::vector<float> acc(total);
        for (std::size_t r = 0; r < n; ++r) {
          const auto* x = static_cast<const std::uint16_t*>(g.calls[r].send);
          for (std::size_t i = 0; i < total; ++i) {
            const float v = widen(first.type, x[i]);
            if (r == 0) {
              acc[i] = v;
            } else if (first.op == ncclSum || first.op == ncclAvg) {
              acc[i] += v;
            } else if (first.op == ncclProd) {
              acc[i] *= v;
            } else if (first.op == ncclMax) {
              acc[i] = acc[i] < v ? v : acc[i];
            } else {
              acc[i] = v < acc[i] ? v : acc[i];
            }
          }
        }
        g.result.resize(total * 2);
        for (std::size_t i = 0; i < total; ++i) {
          const float v = first.op == ncclAvg ? acc[i] / static_cast<float>(n) : acc[i];
          const std::uint16_t b = narrow(first.type, v);
          std::memcpy(g.result.data() + 2 * i, &b, 2);
        }
        break;
      }
      g.result.assign(static_cast<const unsigned char*>(first.send),
                      static_cast<const unsigned char*>(first.send) + total * size);
      for (std::size_t r = 1; r < n; ++r) reduce_typed(g.result.data(), g.calls[r].send, total, first.type, first.op);
      if (first.op == ncclAvg) {
        for (std::size_t i = 0; i < total; ++i) {
          if (first.type == ncclFloat32) reinterpret_cast<float*>(g.result.data())[i] /= static_cast<float>(n);
          if (first.type == ncclFloat64) reinterpret_cast<double*>(g.result.data())[i] /= static_cast<double>(n);
        }
      }
      break;
    }
    case Kind::all_gather:
      g.result.resize(first.count * size * n);
      for (std::size_t r = 0; r < n; ++r) {
        std::memcpy(g.result.data() + r * first.count * size, g.calls[r].send, first.count * size);
      }
      break;
  }
  g.status = ncclSuccess;
  g.message.clear();
}

bool device_buffer(const void* p, std::size_t bytes) {
  if (bytes == 0) return true;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

ncclResult_t run(ncclComm* comm, const Call& call) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(call.stream, &capture) != cudaSuccess) {
    return fail(ncclUnhandledCudaError, "cudaStreamIsCapturing failed on the collective's stream");
  }
  if (capture != cudaStreamCaptureStatusNone) {
    return fail(ncclInvalidUsage, "the emulated NCCL runs collectives at once and cannot capture them in a CUDA graph");
  }
  // Ordered after everything enqueued before it on its stream.
  if (cudaStreamSynchronize(call.stream) != cudaSuccess) {
    return fail(ncclUnhandledCudaError, "the collective's stream failed before it");
  }
  Group& g = *comm->group;
  std::unique_lock<std::mutex> lock(g.mutex);
  g.calls[static_cast<std::size_t>(comm->rank)] = call;
  if (++g.arrived == g.nranks) {
    combine_calls(g);
    g.arrived = 0;
    ++g.generation;
    g.changed.notify_all();
  } else {
    const std::uint64_t generation = g.generation;
    if (!g.changed.wait_for(lock, kPatience, [&] { return g.generation != generation; })) {
      return fail(ncclSystemError, "rank " + std::to_string(comm->rank) + " waited " +
                                       std::to_string(kPatience.count()) + " s for the other ranks of its communicator");
    }
  }
  if (g.status != ncclSuccess) return fail(g.status, g.message);
  const std::size_t size = type_size(call.type);
  const std::size_t n = static_cast<std::size_t>(g.nranks);
  switch (call.kind) {
    case Kind::all_reduce:
      std::memcpy(call.recv, g.result.data(), call.count * size);
      break;
    case Kind::reduce_scatter:
      std::memcpy(call.recv, g.result.data() + static_cast<std::size_t>(comm->rank) * call.count * size,
                  call.count * size);
      break;
    case Kind::all_gather:
      std::memcpy(call.recv, g.result.data(), call.count * size * n);
      break;
  }
  // The next collective's last arrival overwrites g.result only after every rank has arrived
  // again, that is, after every rank has copied this one out.
  return ncclSuccess;
}

// Operations issued between ncclGroupStart and ncclGroupEnd on this thread.
thread_local int t_group_depth = 0;
thread_local std::vector<std::pair<ncclComm*, Call>> t_grouped;

ncclResult_t issue(ncclComm* comm, const Call& call, std::size_t send_elems, std::size_t recv_elems) {
  if (comm == nullptr || comm->group == nullptr) return fail(ncclInvalidArgument, "null communicator");
  const std::size_t size = type_size(call.type);
  if (size == 0) return fail(ncclInvalidArgument, "data type not supported by the emulated NCCL");
  if (call.kind != Kind::all_gather && (call.op < ncclSum || call.op > ncclAvg)) {
    return fail(ncclInvalidArgument, "reduction op not supported by the emulated NCCL");
  }
  if (call.kind != Kind::all_gather && call.op == ncclAvg && call.type != ncclFloat16 &&
      call.type != ncclBfloat16 && call.type != ncclFloat32 && call.type != ncclFloat64) {
    return fail(ncclInvalidArgument, "ncclAvg needs a floating-point type");
  }
  if (!device_buffer(call.send, send_elems * size) || !device_buffer(call.recv, recv_elems * size)) {
    return fail(ncclInvalidArgument, "send and receive buffers must be device memory");
  }
  if (t_group_depth > 0) {
    t_grouped.emplace_back(comm, call);
    return ncclSuccess;
  }
  return run(comm, call);
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return fail(ncclInvalidArgument, "null version");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) { return t_last_error.c_str(); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return fail(ncclInvalidArgument, "null id");
  static std::mutex m;
  static std::mt19937_64 random(std::random_device{}());
  std::lock_guard<std::mutex> lock(m);
  for (std::size_t i = 0; i < NCCL_UNIQUE_ID_BYTES; i += 8) {
    const std::uint64_t r = random();
    std::memcpy(id->internal + i, &r, 8);
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (comm == nullptr) return fail(ncclInvalidArgument, "null communicator pointer");
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return fail(ncclInvalidArgument, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return fail(ncclUnhandledCudaError, "cudaGetDevice failed");
  const std::string key(id.internal, NCCL_UNIQUE_ID_BYTES);
  std::unique_lock<std::mutex> lock(g_pending_mutex);
  Pending& p = g_pending[key];
  if (p.nranks == 0) {
    p.nranks = nranks;
    p.taken.assign(static_cast<std::size_t>(nranks), false);
    p.group = std::make_shared<Group>(nranks);
  }
  if (p.nranks != nranks || p.taken[static_cast<std::size_t>(rank)]) {
    return fail(ncclInvalidArgument, "rank " + std::to_string(rank) + " joins a communicator of " +
                                         std::to_string(p.nranks) + " ranks twice or with another size");
  }
  p.taken[static_cast<std::size_t>(rank)] = true;
  std::shared_ptr<Group> group = p.group;
  if (++p.joined == nranks) {
    g_pending.erase(key);
    g_pending_changed.notify_all();
  } else if (!g_pending_changed.wait_for(lock, kPatience, [&] { return g_pending.count(key) == 0; })) {
    return fail(ncclSystemError, "rank " + std::to_string(rank) + " waited for the others to join");
  }
  auto* c = new ncclComm;
  c->group = group;
  c->rank = rank;
  c->device = device;
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  return comm == nullptr ? fail(ncclInvalidArgument, "null communicator") : ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  if (comm == nullptr || async == nullptr) return fail(ncclInvalidArgument, "null argument");
  *async = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return fail(ncclInvalidArgument, "null argument");
  *count = comm->group->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (comm == nullptr || device == nullptr) return fail(ncclInvalidArgument, "null argument");
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return fail(ncclInvalidArgument, "null argument");
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<std::pair<ncclComm*, Call>> calls;
  calls.swap(t_grouped);
  ncclResult_t result = ncclSuccess;
  for (auto& [comm, call] : calls) {
    const ncclResult_t r = run(comm, call);
    if (result == ncclSuccess) result = r;
  }
  return result;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return issue(comm, Call{Kind::all_reduce, send, recv, count, type, op, stream}, count, count);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t n = comm != nullptr && comm->group ? static_cast<std::size_t>(comm->group->nranks) : 0;
  return issue(comm, Call{Kind::reduce_scatter, send, recv, recv_count, type, op, stream},
               recv_count * n, recv_count);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  const std::size_t n = comm != nullptr && comm->group ? static_cast<std::size_t>(comm->group->nranks) : 0;
  return issue(comm, Call{Kind::all_gather, send, recv, send_count, type, ncclSum, stream},
               send_count, send_count * n);
}

}  // extern "C"

// Full checkpoints in the safetensors format: an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the tensors' bytes back to back.
// Buffers are copied through the host one tensor at a time, by the backend (FusedAdamW::Impl). A checkpoint is
// input: the header is checked by safetensors_header.cpp, and every value here, all before the
// first byte of the optimizer is written.
#include "halfstep/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include "block8.hpp"
#include "block8_geometry.hpp"
#include "check.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"
#include "halfstep/version.hpp"
#include "safetensors_header.hpp"

namespace halfstep {
namespace {

using detail::concat;
using detail::corrupt;
using detail::kStateKey;
using detail::kVersionKey;
using detail::require;
using Json = nlohmann::ordered_json;

// What a stored tensor is to one of the optimizer's tensors. The scales are block8 moments' block
// scales, beside their codes.
enum class Role { master, exp_avg, exp_avg_sq, model, exp_avg_scale, exp_avg_sq_scale };

// One stored tensor: a part (master, moment or model copy) of one of the optimizer's tensors. In
// the file a master is always its fp32 values (with remainders: rebuilt from the model copy;
// without a master: the bf16 model copy's values), a moment its stored format's, a model copy its
// format's. A moment of a tensor with block8 codes (quantized: moment_blocks) is stored as its
// codes (U8, shaped [rows, row] of the whole tensor) and, as name + ".scale", its block scales
// (F32, [rows, blocks a row]).
struct Part {
  std::string name;
  Role role;
  std::size_t tensor;       // the optimizer's tensor it belongs to
  std::int64_t numel;       // elements (a scale part: blocks)
  bool has_model;           // the tensor has a model copy, which its master must round to finitely
  std::int64_t offset = 0;  // loading a shard: the first element (block) of the stored tensor it takes
  bool slice = false;       // loading a shard: the stored tensor may be longer
  bool codes = false;       // a moment this optimizer holds as block8 codes (and a scale part's)
};

bool is_scale(Role r) { return r == Role::exp_avg_scale || r == Role::exp_avg_sq_scale; }
bool is_moment(Role r) { return r == Role::exp_avg || r == Role::exp_avg_sq; }

std::size_t dtype_bytes(const std::string& dtype) { return dtype == "F32" ? 4 : dtype == "U8" ? 1 : 2; }

const char* model_code(DType d) { return d == DType::bf16 ? "BF16" : "F16"; }
const char* moment_code(MomentFormat f) { return f == MomentFormat::bf16 ? "BF16" : "F32"; }

// The stored parts of each of opt's tensors. With a shard, tensor t is elements [offset[t], ...)
// of the stored tensor names[source[t]], and pieces of one stored tensor may repeat its name.
std::vector<Part> parts_of(const FusedAdamW& opt, const std::vector<std::string>& names, bool include_model,
                           const Shard* shard = nullptr) {
  const std::vector<ParamTensor>& tensors = opt.tensors();
  if (shard != nullptr) {
    require(shard->tensors.size() == tensors.size() && shard->source.size() == tensors.size() &&
                shard->offset.size() == tensors.size(),
            "the shard describes ", shard->tensors.size(), " tensors; this optimizer has ", tensors.size());
  } else {
    require(names.size() == tensors.size(), "names must hold one name per tensor (", tensors.size(),
            "), got ", names.size());
  }
  std::vector<Part> parts;
  std::set<std::string> seen;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    std::size_t name_index = t;
    std::int64_t offset = 0;
    if (shard != nullptr) {
      require(shard->source[t] >= 0 && static_cast<std::size_t>(shard->source[t]) < names.size(),
              "shard.source[", t, "] = ", shard->source[t], " names none of the ", names.size(), " names");
      require(shard->offset[t] >= 0, "shard.offset[", t, "] must be >= 0, got ", shard->offset[t]);
      require(shard->tensors[t].numel == p.numel, "shard.tensors[", t, "] has ", shard->tensors[t].numel,
              " elements; this optimizer's tensor ", t, " has ", p.numel);
      name_index = static_cast<std::size_t>(shard->source[t]);
      offset = shard->offset[t];
    }
    const std::string& base = names[name_index];
    require(!base.empty(), "names[", name_index, "] is empty");
    const MomentBlocks blocks = moment_blocks(opt.config(), p);
    auto add = [&](const std::string& name, Role role) {
      require(name != "__metadata__" && (shard != nullptr || seen.insert(name).second), "names[", t,
              "] makes the tensor name '", name,
              "' twice (names must be distinct, also with the suffixes .exp_avg, .exp_avg_sq, .model, "
              ".exp_avg.scale, .exp_avg_sq.scale)");
      Part part{name, role, t, p.numel, p.model != nullptr, offset, shard != nullptr, blocks.quantized && role != Role::master && role != Role::model};
      if (is_scale(role)) {  // the piece's blocks, from the first of the stored tensor's
        part.numel = blocks.blocks;
        part.offset = blocks.first - detail::block8_geometry_of(p).first_block_from(p.offset - offset);
      }
      parts.push_back(part);
    };
    add(base, Role::master);
    add(base + ".exp_avg", Role::exp_avg);
    add(base + ".exp_avg_sq", Role::exp_avg_sq);
    if (blocks.quantized) {
      add(base + ".exp_avg.scale", Role::exp_avg_scale);
      add(base + ".exp_avg_sq.scale", Role::exp_avg_sq_scale);
    }
    if (p.model != nullptr && include_model) add(base + ".model", Role::model);
  }
  return parts;
}

// A part's values as checkpoints speak of them: fp32 values (masters and moments, whatever their
// stored format; block scales) or a model copy's patterns; a block8 moment's codes, and on load
// its block scales beside them.
struct Values {
  std::vector<float> f;
  std::vector<std::uint16_t> bits;
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
};

float bf16_float(std::uint16_t b) {
  const std::uint32_t w = static_cast<std::uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &w, 4);
  return x;
}
std::uint32_t float_bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float bits_float(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Why part p's values cannot be in a checkpoint, or "" if they can. Refused is what a step never
// writes and what would make steps report `applied` over garbage: a master or moment that is not
// finite, a negative second moment (√v), a master whose model copy would not be finite (every step
// would hold it: past 65504 for fp16), a model copy that is inf or NaN. Elements are counted in
// the stored tensor.
std::string bad_value(const Part& p, const Values& v, DType model_dtype) {
  const auto first = static_cast<std::size_t>(p.offset);
  if (p.role == Role::model) {
    for (std::size_t i = 0; i < v.bits.size(); ++i) {
      const BitClass k = classify_bits16(model_dtype, v.bits[i]);
      if (k == BitClass::infinite || k == BitClass::nan) {
        return concat("element ", first + i, " is ", k == BitClass::nan ? "NaN" : "infinite", " (", dtype_name(model_dtype),
                      " bits 0x", std::hex, v.bits[i], std::dec, "): a model copy must be finite");
      }
    }
    return "";
  }
  if (is_scale(p.role)) {
    for (std::size_t i = 0; i < v.f.size(); ++i) {
      if (!detail::finite(v.f[i]) || v.f[i] < 0.0f) {
        return concat("block ", first + i, "'s scale is ", v.f[i], ": a block scale must be finite and >= 0");
      }
    }
    return "";
  }
  for (std::size_t i = 0; i < v.f.size(); ++i) {
    const float x = v.f[i];
    if (!detail::finite(x)) {
      return concat("element ", first + i, " is ", x, ": ",
                    p.role == Role::master ? "a master" : "a moment", " must be finite");
    }
    if (p.role == Role::exp_avg_sq && x < 0.0f) {
      return concat("element ", first + i, " is ", x, ": a second moment must be >= 0");
    }
    if (p.role == Role::master && p.has_model &&
        classify_bits16(model_dtype, to_bits16(model_dtype, x)) == BitClass::infinite) {
      return concat("element ", first + i, " is ", x, ": a master must round to a finite ", dtype_name(model_dtype),
                    " model copy (the largest ", dtype_name(model_dtype), " value is ", format_info(model_dtype).max, ")");
    }
  }
  return "";
}

// Copies `n` elements of `bytes` each out of one of opt's buffers.
std::vector<char> copy_out(FusedAdamW& opt, const void* buffer, std::size_t n, std::size_t bytes) {
  std::vector<char> out(n * bytes);
  if (!out.empty()) detail::FusedAccess::impl(opt).copy_out(out.data(), buffer, out.size());
  return out;
}

// Part p's values as opt holds them (masters rebuilt from remainders).
Values read_part(FusedAdamW& opt, const Part& p) {
  const ParamTensor& t = opt.tensors()[p.tensor];
  const StateFormat& f = opt.config().state;
  const auto n = static_cast<std::size_t>(p.numel);
  Values v;
  auto floats = [&](const void* buffer, bool bf16) {
    const std::vector<char> raw = copy_out(opt, buffer, n, bf16 ? 2 : 4);
    v.f.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (bf16) {
        std::uint16_t b;
        std::memcpy(&b, raw.data() + 2 * i, 2);
        v.f[i] = bf16_float(b);
      } else {
        std::memcpy(&v.f[i], raw.data() + 4 * i, 4);
      }
    }
  };
  switch (p.role) {
    case Role::master:
      if (f.master == MasterFormat::none) {  // the bf16 model copy is the weight
        floats(t.model, true);
      } else if (f.master == MasterFormat::bf16_remainder) {
        const std::vector<char> rest = copy_out(opt, t.master, n, 2), model = copy_out(opt, t.model, n, 2);
        v.f.resize(n);
        for (std::size_t i = 0; i < n; ++i) {
          std::int16_t r;
          std::uint16_t m;
          std::memcpy(&r, rest.data() + 2 * i, 2);
          std::memcpy(&m, model.data() + 2 * i, 2);
          v.f[i] = bits_float(join_master(m, r));
        }
      } else {
        floats(t.master, false);
      }
      break;
    case Role::exp_avg:
    case Role::exp_avg_sq: {
      const void* buffer = p.role == Role::exp_avg ? t.exp_avg : t.exp_avg_sq;
      if (p.codes) {
        const std::vector<char> raw = copy_out(opt, buffer, n, 1);
        v.codes.assign(raw.begin(), raw.end());
      } else {
        floats(buffer, (p.role == Role::exp_avg ? f.exp_avg : f.exp_avg_sq) == MomentFormat::bf16);
      }
      break;
    }
    case Role::exp_avg_scale: floats(t.exp_avg_scale, false); break;
    case Role::exp_avg_sq_scale: floats(t.exp_avg_sq_scale, false); break;
    case Role::model: {
      const std::vector<char> raw = copy_out(opt, t.model, n, 2);
      v.bits.resize(n);
      std::copy_n(raw.data(), raw.size(), reinterpret_cast<char*>(v.bits.data()));
      break;
    }
  }
  return v;
}

// The dtype a part has in a file this optimizer writes.
const char* stored_dtype(const FusedAdamW& opt, const Part& p) {
  const StateFormat& f = opt.config().state;
  switch (p.role) {
    case Role::master: return "F32";
    case Role::exp_avg: return p.codes ? "U8" : moment_code(f.exp_avg);
    case Role::exp_avg_sq: return p.codes ? "U8" : moment_code(f.exp_avg_sq);
    case Role::model: return model_code(opt.config().model_dtype);
    case Role::exp_avg_scale:
    case Role::exp_avg_sq_scale: return "F32";
  }
  return "";
}

// Part p's values as the file stores them.
std::string file_bytes(const FusedAdamW& opt, const Part& p, const Values& v) {
  std::string out;
  if (p.role == Role::model) {
    out.resize(2 * v.bits.size());
    std::copy_n(reinterpret_cast<const char*>(v.bits.data()), out.size(), out.data());
    return out;
  }
  if (p.codes && is_moment(p.role)) return std::string(v.codes.begin(), v.codes.end());
  const bool bf16 = std::strcmp(stored_dtype(opt, p), "BF16") == 0;
  out.resize((bf16 ? 2 : 4) * v.f.size());
  for (std::size_t i = 0; i < v.f.size(); ++i) {
    if (bf16) {
      const auto b = static_cast<std::uint16_t>(float_bits(v.f[i]) >> 16);  // exact: a bf16 moment's value
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &v.f[i], 4);
    }
  }
  return out;
}

// errno's text, for messages about files.
std::string os_error() { return std::strerror(errno); }

[[noreturn]] void cannot_write(const std::string& path, const std::string& why) {
  throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": ", why));
}

// The directory `path` is in ("." for a bare name).
std::string directory_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Refuses, before any work, a target save_checkpoint must not or cannot replace: an existing
// path that is not a regular file (a device, a FIFO, a directory: renaming over /dev/null as
// root would replace the device), a directory that does not exist or is not writable, and a
// leftover `tmp` that is not a regular file.
void check_target(const std::string& path, const std::string& tmp) {
  if (path.empty()) cannot_write(path, "the path is empty");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      cannot_write(path, concat("it exists and is not a regular file (",
                                S_ISDIR(st.st_mode) ? "a directory" : S_ISCHR(st.st_mode) ? "a character device"
                                : S_ISBLK(st.st_mode) ? "a block device" : S_ISFIFO(st.st_mode) ? "a FIFO"
                                : S_ISSOCK(st.st_mode) ? "a socket" : "another kind of file",
                                "); a checkpoint replaces only a regular file"));
    }
  } else if (errno != ENOENT && errno != ENOTDIR) {  // the directory is checked next
    cannot_write(path, concat("cannot look it up: ", os_error()));
  }
  const std::string dir = directory_of(path);
  if (::stat(dir.c_str(), &st) != 0) cannot_write(path, concat("its directory '", dir, "' does not exist"));
  if (!S_ISDIR(st.st_mode)) cannot_write(path, concat("its directory '", dir, "' is not a directory"));
  if (::faccessat(AT_FDCWD, dir.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    cannot_write(path, concat("its directory '", dir, "' is not writable (", os_error(), ")"));
  }
  if (::lstat(tmp.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    cannot_write(path, concat(tmp, ", where it is written first, exists and is not a regular file"));
  }
}

// The file a checkpoint is written to before it replaces the target: created afresh (a leftover
// of a failed save is removed, never written through: it might be a link to another file) and
// removed again unless kept.
class PartialFile {
 public:
  PartialFile(const std::string& target, std::string path) : target_(target), path_(std::move(path)) {
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) cannot_write(target_, concat("cannot remove ", path_, ": ", os_error()));
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd_ < 0) cannot_write(target_, concat("cannot create ", path_, ": ", os_error()));
  }
  PartialFile(const PartialFile&) = delete;
  PartialFile& operator=(const PartialFile&) = delete;
  ~PartialFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!kept_) ::unlink(path_.c_str());
  }

  void write(const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ::ssize_t n = ::write(fd_, p, std::min<std::size_t>(bytes, std::size_t{1} << 30));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) cannot_write(target_, concat("writing ", path_, " failed: ", n < 0 ? os_error() : "nothing written"));
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }

  // Flushes to the disk and closes: errors of delayed writes (ENOSPC, EIO, quotas) show here.
  void finish() {
    if (::fsync(fd_) != 0) cannot_write(target_, concat("writing ", path_, " failed (fsync): ", os_error()));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) cannot_write(target_, concat("writing ", path_, " failed (close): ", os_error()));
  }

  // Replaces the target with the finished file.
  void replace_target() {
    if (std::rename(path_.c_str(), target_.c_str()) != 0) {
      cannot_write(target_, concat("cannot replace it with ", path_, ": ", os_error()));
    }
    kept_ = true;
  }

 private:
  std::string target_, path_;
  int fd_ = -1;
  bool kept_ = false;
};

}  // namespace

void save_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names, const std::string& path,
                     const CheckpointOptions& options) {
  std::vector<Part> parts = parts_of(opt, names, options.include_model);
  for (std::size_t t = 0; t < opt.tensors().size(); ++t) {  // codes are stored in their whole tensor's shape
    const ParamTensor& p = opt.tensors()[t];
    require(!moment_blocks(opt.config(), p).quantized || (p.offset == 0 && detail::whole_numel_of(p) == p.numel),
            "save_checkpoint: tensors[", t, "] is a piece (elements [", p.offset, ", ", p.offset + p.numel, ") of ",
            detail::whole_numel_of(p), ") of a tensor with block8 moments, whose codes and scales a checkpoint "
            "stores whole: save from an optimizer over whole tensors (gather the shards; load_checkpoint with a "
            "Shard then reads each rank's slices)");
  }
  for (const auto& [key, value] : options.metadata) {
    require(key.rfind("halfstep.", 0) != 0, "CheckpointOptions.metadata key '", key,
            "' starts with 'halfstep.', which halfstep's own keys use");
  }
  // Write next to the target, then replace it: a failure leaves any earlier checkpoint intact.
  const std::string tmp = path + ".partial";
  check_target(path, tmp);
  const std::string state = opt.save_state();  // waits for the last step

  // The 4-byte tensors first, then the 2-byte ones (model copies, bf16 moments), then the bytes
  // (block8 codes): every tensor starts at a multiple of its element size (an odd-length model
  // copy would misalign the masters after it).
  auto bytes_of = [&](const Part& p) { return static_cast<std::uint64_t>(p.numel) * dtype_bytes(stored_dtype(opt, p)); };
  std::stable_sort(parts.begin(), parts.end(), [&](const Part& a, const Part& b) {
    return dtype_bytes(stored_dtype(opt, a)) > dtype_bytes(stored_dtype(opt, b));
  });
  // Codes and scales in their tensor's rows, so that a load reads the blocks from the file itself.
  auto shape_of = [&](const Part& p) {
    if (!p.codes) return Json::array({p.numel});
    const detail::Block8Geometry g = detail::block8_geometry_of(opt.tensors()[p.tensor]);
    return Json::array({g.numel / g.row, is_scale(p.role) ? g.blocks_per_row : g.row});
  };
  Json header = Json::object();
  std::uint64_t offset = 0;
  for (const Part& p : parts) {
    header[p.name] = {{"dtype", stored_dtype(opt, p)}, {"shape", shape_of(p)}, {"data_offsets", {offset, offset + bytes_of(p)}}};
    offset += bytes_of(p);
  }
  Json meta = Json::object();
  meta[kVersionKey] = version();
  meta[kStateKey] = detail::to_hex(state);
  for (const auto& [key, value] : options.metadata) meta[key] = value;
  header["__metadata__"] = meta;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned

  PartialFile f(path, tmp);
  unsigned char size[8];
  for (int i = 0; i < 8; ++i) size[i] = static_cast<unsigned char>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xFFu);
  f.write(size, 8);
  f.write(text.data(), text.size());
  for (const Part& p : parts) {  // one part at a time through the host
    const Values v = read_part(opt, p);
    // A checkpoint that could not be loaded is never written.
    const std::string bad = bad_value(p, v, opt.config().model_dtype);
    if (!bad.empty()) {
      throw Error(ErrorKind::usage, concat("save_checkpoint: the optimizer cannot be checkpointed: tensor '", p.name,
                                           "' ", bad));
    }
    const std::string bytes = file_bytes(opt, p, v);
    f.write(bytes.data(), bytes.size());
  }
  f.finish();
  f.replace_target();
}

namespace {

// The checkpoint at `path`, opened for reading: a regular file (a FIFO would block the open, a
// device would be read as a file).
std::ifstream open_checkpoint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": cannot read it: ", os_error()));
  }
  if (!S_ISREG(st.st_mode)) throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": not a regular file"));
  return std::ifstream(path, std::ios::binary);
}

}  // namespace

std::map<std::string, std::string> checkpoint_metadata(const std::string& path) {
  std::ifstream f = open_checkpoint(path);
  return detail::read_safetensors_header(f, path).metadata;
}

namespace {

// Part p's values in a file's tensor of dtype `dtype` (one load_parts accepted), decoded.
void decode_part(const Part& p, const std::string& dtype, const std::vector<char>& raw, Values& v) {
  const auto n = static_cast<std::size_t>(p.numel);
  if (p.role == Role::model) {
    v.bits.resize(n);
    std::copy_n(raw.data(), 2 * n, reinterpret_cast<char*>(v.bits.data()));
    return;
  }
  v.f.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (dtype == "BF16") {
      std::uint16_t b;
      std::memcpy(&b, raw.data() + 2 * i, 2);
      v.f[i] = bf16_float(b);
    } else {
      std::memcpy(&v.f[i], raw.data() + 4 * i, 4);
    }
  }
}


// A moment stored as block8 codes (`raw`: the part's codes) and, as name + ".scale", its block
// scales, in the stored tensor's rows (its shape [rows, row]; one row if one-dimensional). Where
// this optimizer holds the part as codes in the same blocks, `v` takes the codes and scales as they
// are (exact); otherwise their values (decoded, exp_avg_sq squared in double), for the
// optimizer's format.
void read_codes(const FusedAdamW& opt, const Part& p, const detail::SafetensorsEntry& e,
                const detail::SafetensorsHeader& h, std::ifstream& f, const std::string& path,
                const std::vector<char>& raw, Values& v) {
  const std::string where = concat("tensor '", p.name, "'");
  const auto numel = static_cast<std::int64_t>(e.numel);
  const std::int64_t row = e.dims >= 2 ? static_cast<std::int64_t>(e.last) : numel;
  const detail::Block8Geometry stored = detail::block8_geometry(numel, row);
  if (!stored.quantized) {
    corrupt(path, concat(where, " holds U8 block8 codes of ", numel, " elements in rows of ", row,
                         ", a shape whose moments are never in blocks (under 4096 elements, rows under 32, or rows that "
                         "do not divide it)"));
  }
  const std::string scale_name = p.name + ".scale";
  const auto it = h.tensors.find(scale_name);
  if (it == h.tensors.end()) corrupt(path, concat(where, " holds block8 codes, and the file has no '", scale_name, "'"));
  const detail::SafetensorsEntry& s = it->second;
  if (s.dtype != "F32" || s.numel != static_cast<std::uint64_t>(stored.blocks)) {
    corrupt(path, concat("tensor '", scale_name, "' is ", s.dtype, " of ", s.numel, " elements; the codes of ", where,
                         " in rows of ", row, " need F32 of ", stored.blocks, " (a scale per block)"));
  }
  const std::int64_t first = stored.block_of(p.offset);
  const std::int64_t count = p.numel > 0 ? stored.block_of(p.offset + p.numel - 1) - first + 1 : 0;
  Values sv;
  sv.f.resize(static_cast<std::size_t>(count));
  f.seekg(static_cast<std::streamoff>(8 + h.header_bytes + s.begin + static_cast<std::uint64_t>(first) * 4));
  f.read(reinterpret_cast<char*>(sv.f.data()), static_cast<std::streamsize>(4 * sv.f.size()));
  if (!f) corrupt(path, concat("reading tensor '", scale_name, "' failed"));
  Part scale_part = p;
  scale_part.role = p.role == Role::exp_avg ? Role::exp_avg_scale : Role::exp_avg_sq_scale;
  scale_part.offset = first;
  const std::string bad = bad_value(scale_part, sv, opt.config().model_dtype);
  if (!bad.empty()) corrupt(path, concat("tensor '", scale_name, "' ", bad));

  const ParamTensor& t = opt.tensors()[p.tensor];
  const detail::Block8Geometry mine = detail::block8_geometry_of(t);
  if (p.codes && mine.numel == stored.numel && mine.row == stored.row && t.offset == p.offset) {
    v.codes.assign(raw.begin(), raw.end());
    v.scales = std::move(sv.f);
    return;
  }
  ParamTensor in_file;  // the part as a piece of the file's tensor, in the file's blocks
  in_file.numel = p.numel;
  in_file.whole_numel = numel;
  in_file.row = row;
  in_file.offset = p.offset;
  v.f.resize(static_cast<std::size_t>(p.numel));
  decode_moment(in_file, p.role == Role::exp_avg ? Slot::exp_avg : Slot::exp_avg_sq,
                reinterpret_cast<const std::uint8_t*>(raw.data()), sv.f.data(), v.f.data());
}

std::map<std::string, std::string> load_parts(FusedAdamW& opt, const std::vector<Part>& parts, const std::string& path) {
  // Read and check everything first: the header, the state, then every part's values in host
  // memory. Only then is anything written.
  std::ifstream f = open_checkpoint(path);
  const detail::SafetensorsHeader h = detail::read_safetensors_header(f, path);
  if (h.state.empty()) corrupt(path, concat("no '", kStateKey, "' in the metadata: not a halfstep checkpoint"));
  try {
    (void)halfstep::load_state(h.state, opt.config());  // checks the state; changes nothing
  } catch (const Error& e) {
    corrupt(path, e.what());
  }

  const StepConfig& config = opt.config();
  const DType model_dtype = config.model_dtype;
  const bool remainder = config.state.master == MasterFormat::bf16_remainder;
  const bool no_master = config.state.master == MasterFormat::none;
  const std::uint64_t data_start = 8 + h.header_bytes;
  std::vector<Values> values(parts.size());
  std::vector<bool> present(parts.size(), false);
  std::vector<std::size_t> master_of(opt.tensors().size(), parts.size());
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const Part& p = parts[k];
    if (p.role == Role::master) master_of[p.tensor] = k;
    if (is_scale(p.role)) continue;  // read with its codes
    const auto it = h.tensors.find(p.name);
    if (it == h.tensors.end()) {
      if (p.role != Role::model) corrupt(path, concat("no tensor '", p.name, "'"));
      continue;
    }
    const detail::SafetensorsEntry& e = it->second;
    const auto where = concat("tensor '", p.name, "'");
    // A master is stored as F32, a moment as F32, BF16 or U8 block8 codes (converted to this
    // optimizer's format), a model copy in this optimizer's model format.
    const std::string model = model_code(model_dtype);
    const bool accepted = p.role == Role::model ? e.dtype == model
                          : e.dtype == "F32" || (p.role != Role::master && (e.dtype == "BF16" || e.dtype == "U8"));
    if (!accepted) {
      corrupt(path, concat(where, " is ", e.dtype, ", this optimizer needs ",
                           p.role == Role::model ? model : p.role == Role::master ? "F32" : "F32, BF16 or U8"));
    }
    const std::uint64_t wanted = static_cast<std::uint64_t>(p.offset) + static_cast<std::uint64_t>(p.numel);
    if (p.slice ? e.numel < wanted : e.numel != wanted) {
      corrupt(path, p.slice ? concat(where, " has ", e.numel, " elements; this shard needs [", p.offset, ", ", wanted, ")")
                            : concat(where, " has ", e.numel, " elements, this optimizer's tensor has ", p.numel));
    }
    const std::size_t elem = dtype_bytes(e.dtype);
    std::vector<char> raw(static_cast<std::size_t>(p.numel) * elem);
    f.seekg(static_cast<std::streamoff>(data_start + e.begin + static_cast<std::uint64_t>(p.offset) * elem));
    f.read(raw.data(), static_cast<std::streamsize>(raw.size()));
    if (!f) corrupt(path, concat("reading ", where, " failed"));
    if (e.dtype == "U8") {
      read_codes(opt, p, e, h, f, path, raw, values[k]);
    } else {
      decode_part(p, e.dtype, raw, values[k]);
    }
    // With a bf16 model copy a master is canonical (halfstep::canonical_master): what a step of
    // either master format would have stored, so that both resume alike.
    if (p.role == Role::master && p.has_model && model_dtype == DType::bf16) {
      for (float& x : values[k].f) {
        if (detail::finite(x)) x = bits_float(canonical_master(float_bits(x)));
      }
    }
    const std::string bad = values[k].codes.empty() ? bad_value(p, values[k], model_dtype) : "";
    if (!bad.empty()) corrupt(path, concat(where, " ", bad));
    present[k] = true;
  }

  // Then write: buffers and the state. Model copies the file lacks are the restored masters
  // rounded, as a step would write them; with remainders the model copy is half of the master.
  FusedAdamW::Impl& backend = detail::FusedAccess::impl(opt);
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const Part& p = parts[k];
    const ParamTensor& t = opt.tensors()[p.tensor];
    const auto n = static_cast<std::size_t>(p.numel);
    if (is_scale(p.role)) continue;  // written with the codes
    if (p.codes) {  // block8 codes and scales: as stored, or encoded from the values
      Values& v = values[k];
      if (v.codes.empty()) {  // to nearest, as a conversion of fp32 into bf16 rounds
        v.codes.resize(n);
        v.scales.resize(static_cast<std::size_t>(moment_blocks(config, t).blocks));
        encode_moment(t, p.role == Role::exp_avg ? Slot::exp_avg : Slot::exp_avg_sq, v.f.data(), v.codes.data(),
                      v.scales.data());
      }
      const bool m = p.role == Role::exp_avg;
      backend.copy_in(m ? t.exp_avg : t.exp_avg_sq, v.codes.data(), n);
      backend.copy_in(m ? t.exp_avg_scale : t.exp_avg_sq_scale, v.scales.data(), 4 * v.scales.size());
      continue;
    }
    if (p.role == Role::model) {
      if (remainder || no_master) continue;  // written with the master
      std::vector<std::uint16_t> bits = values[k].bits;
      if (!present[k]) {
        const std::vector<float>& master = values[master_of[p.tensor]].f;
        bits.resize(n);
        for (std::size_t i = 0; i < n; ++i) bits[i] = to_bits16(model_dtype, master[i]);
      }
      backend.copy_in(t.model, bits.data(), 2 * n);
      continue;
    }
    const std::vector<float>& x = values[k].f;
    if (p.role == Role::master && remainder) {
      std::vector<std::int16_t> rest(n);
      std::vector<std::uint16_t> model(n);
      for (std::size_t i = 0; i < n; ++i) {
        const bool ok = split_master(float_bits(x[i]), model[i], rest[i]);
        require(ok, "load_checkpoint: master ", i, " of tensor '", p.name, "' does not split");  // canonical, finite: it does
      }
      backend.copy_in(t.master, rest.data(), 2 * n);
      backend.copy_in(t.model, model.data(), 2 * n);
      continue;
    }
    if (p.role == Role::master && no_master) {  // the weight: an fp32 master rounds once, to nearest even
      std::vector<std::uint16_t> model(n);
      for (std::size_t i = 0; i < n; ++i) model[i] = to_bf16_bits(static_cast<double>(x[i]));
      backend.copy_in(t.model, model.data(), 2 * n);
      continue;
    }
    const MomentFormat format = p.role == Role::exp_avg ? config.state.exp_avg
                                : p.role == Role::exp_avg_sq ? config.state.exp_avg_sq : MomentFormat::f32;
    void* buffer = p.role == Role::master ? t.master : p.role == Role::exp_avg ? t.exp_avg : t.exp_avg_sq;
    if (format == MomentFormat::bf16) {  // an fp32 moment rounds once, to nearest even; a bf16 one is exact
      std::vector<std::uint16_t> b(n);
      for (std::size_t i = 0; i < n; ++i) b[i] = to_bf16_bits(static_cast<double>(x[i]));
      backend.copy_in(buffer, b.data(), 2 * n);
    } else {
      backend.copy_in(buffer, x.data(), 4 * n);
    }
  }
  opt.load_state(h.state);
  return h.metadata;
}

}  // namespace

std::map<std::string, std::string> load_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names,
                                                   const std::string& path) {
  return load_parts(opt, parts_of(opt, names, true), path);
}

std::map<std::string, std::string> load_checkpoint(FusedAdamW& opt, const Shard& shard,
                                                   const std::vector<std::string>& names, const std::string& path) {
  return load_parts(opt, parts_of(opt, names, true, &shard), path);
}

}  // namespace halfstep

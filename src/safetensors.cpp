// Full checkpoints in the safetensors format: an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the tensors' bytes back to back.
// Buffers of Backend::cuda are copied through the host one tensor at a time.
#include "halfstep/safetensors.hpp"

#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include "check.hpp"
#include "cuda_check.hpp"
#include "halfstep/checkpoint.hpp"
#include "halfstep/version.hpp"

namespace halfstep {
namespace {

using detail::concat;
using detail::require;
using Json = nlohmann::ordered_json;

constexpr const char* kStateKey = "halfstep.optimizer_state";
constexpr const char* kVersionKey = "halfstep.version";
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;  // what the safetensors package accepts

// One stored tensor: a part (master, moment or model copy) of one of the optimizer's tensors.
struct Part {
  std::string name;
  const char* dtype;   // "F32", "F16" or "BF16"
  void* data;          // the optimizer's buffer (device memory for Backend::cuda)
  std::size_t bytes;
  std::int64_t numel;
  bool optional;       // a model copy: may be missing from a file
  std::int64_t offset = 0;  // loading a shard: the first element of the stored tensor it takes
  std::size_t elem = 0;     // bytes per element
  bool slice = false;       // loading a shard: the stored tensor may be longer
};

const char* dtype_code(DType d) { return d == DType::bf16 ? "BF16" : "F16"; }

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
    const auto n = static_cast<std::size_t>(p.numel);
    auto add = [&](const std::string& name, const char* dtype, void* data, std::size_t elem, bool optional) {
      require(name != "__metadata__" && (shard != nullptr || seen.insert(name).second), "names[", t,
              "] makes the tensor name '", name,
              "' twice (names must be distinct, also with the suffixes .exp_avg, .exp_avg_sq, .model)");
      parts.push_back(Part{name, dtype, data, n * elem, p.numel, optional, offset, elem, shard != nullptr});
    };
    add(base, "F32", p.master, 4, false);
    add(base + ".exp_avg", "F32", p.exp_avg, 4, false);
    add(base + ".exp_avg_sq", "F32", p.exp_avg_sq, 4, false);
    if (p.model != nullptr && include_model) add(base + ".model", dtype_code(opt.config().model_dtype), p.model, 2, true);
  }
  return parts;
}

void copy_out(const FusedAdamW& opt, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (opt.backend() == Backend::cuda) {
    HALFSTEP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  } else {
    std::memcpy(dst, src, bytes);
  }
}

void copy_in(const FusedAdamW& opt, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (opt.backend() == Backend::cuda) {
    HALFSTEP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  } else {
    std::memcpy(dst, src, bytes);
  }
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

[[noreturn]] void corrupt(const std::string& path, const std::string& why) {
  throw Error(ErrorKind::corrupt_state, concat("checkpoint ", path, ": ", why));
}

std::string from_hex(const std::string& path, const std::string& hex) {
  if (hex.size() % 2 != 0) corrupt(path, concat(kStateKey, " has an odd number of hex digits"));
  auto value = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    corrupt(path, concat(kStateKey, " holds '", c, "', not a hex digit"));
  };
  std::string out(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(value(hex[2 * i]) * 16 + value(hex[2 * i + 1]));
  return out;
}

}  // namespace

void save_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names, const std::string& path,
                     const CheckpointOptions& options) {
  const std::vector<Part> parts = parts_of(opt, names, options.include_model);
  for (const auto& [key, value] : options.metadata) {
    require(key.rfind("halfstep.", 0) != 0, "CheckpointOptions.metadata key '", key,
            "' starts with 'halfstep.', which halfstep's own keys use");
  }
  const std::string state = opt.save_state();  // waits for the last step

  Json header = Json::object();
  std::uint64_t offset = 0;
  for (const Part& p : parts) {
    header[p.name] = {{"dtype", p.dtype}, {"shape", {p.numel}}, {"data_offsets", {offset, offset + p.bytes}}};
    offset += p.bytes;
  }
  Json meta = Json::object();
  meta[kVersionKey] = version();
  meta[kStateKey] = to_hex(state);
  for (const auto& [key, value] : options.metadata) meta[key] = value;
  header["__metadata__"] = meta;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned

  // Write next to the target, then replace it: a failure leaves any earlier checkpoint intact.
  const std::string tmp = path + ".partial";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": cannot write ", tmp));
    unsigned char size[8];
    for (int i = 0; i < 8; ++i) size[i] = static_cast<unsigned char>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xFFu);
    f.write(reinterpret_cast<const char*>(size), 8);
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    std::vector<char> buffer;
    for (const Part& p : parts) {
      buffer.resize(p.bytes);
      copy_out(opt, buffer.data(), p.data, p.bytes);
      f.write(buffer.data(), static_cast<std::streamsize>(p.bytes));
    }
    f.flush();
    if (!f) {
      std::remove(tmp.c_str());
      throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": writing ", tmp, " failed"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": cannot replace it with ", tmp));
  }
}

namespace {

// A safetensors file's header, read and parsed.
struct Header {
  Json json;
  std::uint64_t header_bytes = 0, data_bytes = 0;
  std::map<std::string, std::string> metadata;  // the caller's keys
  std::string state;                            // halfstep.optimizer_state, decoded
};

Header read_header(std::ifstream& f, const std::string& path) {
  if (!f) throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": cannot read it"));
  f.seekg(0, std::ios::end);
  const auto file_bytes = static_cast<std::uint64_t>(f.tellg());
  f.seekg(0);
  if (file_bytes < 8) corrupt(path, concat("truncated: ", file_bytes, " bytes, a header length needs 8"));
  unsigned char size[8];
  f.read(reinterpret_cast<char*>(size), 8);
  Header h;
  for (int i = 0; i < 8; ++i) h.header_bytes |= static_cast<std::uint64_t>(size[i]) << (8 * i);
  if (h.header_bytes > kMaxHeaderBytes || h.header_bytes > file_bytes - 8) {
    corrupt(path, concat("the header length ", h.header_bytes, " does not fit a file of ", file_bytes,
                         " bytes (is it a safetensors file?)"));
  }
  std::string text(static_cast<std::size_t>(h.header_bytes), '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  h.data_bytes = file_bytes - 8 - h.header_bytes;
  try {
    h.json = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, concat("the header is not JSON (", e.what(), ")"));
  }
  if (!h.json.is_object()) corrupt(path, "the header is not a JSON object");
  if (h.json.contains("__metadata__")) {
    const Json& meta = h.json["__metadata__"];
    if (!meta.is_object()) corrupt(path, "__metadata__ is not an object");
    for (const auto& [key, value] : meta.items()) {
      if (!value.is_string()) corrupt(path, concat("metadata '", key, "' is not a string"));
      if (key == kStateKey) {
        h.state = from_hex(path, value.get<std::string>());
      } else if (key.rfind("halfstep.", 0) != 0) {
        h.metadata[key] = value.get<std::string>();
      }
    }
  }
  return h;
}

}  // namespace

std::map<std::string, std::string> checkpoint_metadata(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return read_header(f, path).metadata;
}

namespace {

std::map<std::string, std::string> load_parts(FusedAdamW& opt, const std::vector<Part>& parts, const std::string& path) {

  // Read and check everything first.
  std::ifstream f(path, std::ios::binary);
  const Header h = read_header(f, path);
  const Json& header = h.json;
  const std::uint64_t header_bytes = h.header_bytes, data_bytes = h.data_bytes;
  const std::map<std::string, std::string>& metadata = h.metadata;
  const std::string& state = h.state;
  if (state.empty()) corrupt(path, concat("no '", kStateKey, "' in the metadata: not a halfstep checkpoint"));
  try {
    (void)halfstep::load_state(state, opt.config());  // checks the state; changes nothing
  } catch (const Error& e) {
    corrupt(path, e.what());
  }

  struct Found {
    std::uint64_t begin;
    bool present;
  };
  std::vector<Found> found;
  for (const Part& p : parts) {
    if (!header.contains(p.name)) {
      if (!p.optional) corrupt(path, concat("no tensor '", p.name, "'"));
      found.push_back({0, false});
      continue;
    }
    const Json& e = header[p.name];
    const auto where = concat("tensor '", p.name, "'");
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets")) {
      corrupt(path, where + " lacks dtype, shape or data_offsets");
    }
    if (!e["dtype"].is_string() || e["dtype"].get<std::string>() != p.dtype) {
      corrupt(path, concat(where, " is ", e["dtype"].dump(), ", this optimizer needs ", p.dtype));
    }
    if (!e["shape"].is_array()) corrupt(path, where + ": shape is not a list");
    std::uint64_t numel = 1;
    for (const Json& d : e["shape"]) {
      if (!d.is_number_unsigned() || (numel != 0 && d.get<std::uint64_t>() > (UINT64_MAX >> 2) / numel)) {
        corrupt(path, where + ": shape holds a value that is not a size");
      }
      numel *= d.get<std::uint64_t>();
    }
    const std::uint64_t wanted = static_cast<std::uint64_t>(p.offset) + static_cast<std::uint64_t>(p.numel);
    if (p.slice ? numel < wanted : numel != wanted) {
      corrupt(path, p.slice ? concat(where, " has ", numel, " elements; this shard needs [", p.offset, ", ", wanted, ")")
                            : concat(where, " has ", numel, " elements, this optimizer's tensor has ", p.numel));
    }
    const Json& o = e["data_offsets"];
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned()) {
      corrupt(path, where + ": data_offsets is not [begin, end]");
    }
    const auto begin = o[0].get<std::uint64_t>(), end = o[1].get<std::uint64_t>();
    if (begin > end || end > data_bytes || end - begin != numel * p.elem) {
      corrupt(path, concat(where, ": bytes [", begin, ", ", end, ") do not hold ", numel * p.elem,
                           " bytes inside the file's ", data_bytes, " (truncated?)"));
    }
    found.push_back({begin + static_cast<std::uint64_t>(p.offset) * p.elem, true});
  }

  // Then write: buffers, model copies recomputed where the file has none, and the state.
  const std::uint64_t data_start = 8 + header_bytes;
  std::vector<char> buffer;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const Part& p = parts[k];
    if (!found[k].present) continue;
    buffer.resize(p.bytes);
    f.seekg(static_cast<std::streamoff>(data_start + found[k].begin));
    f.read(buffer.data(), static_cast<std::streamsize>(p.bytes));
    if (!f) corrupt(path, concat("reading tensor '", p.name, "' failed"));
    copy_in(opt, p.data, buffer.data(), p.bytes);
  }
  const std::vector<ParamTensor>& tensors = opt.tensors();
  std::size_t k = 0;
  for (const ParamTensor& t : tensors) {
    k += 3;  // master and moments
    if (t.model == nullptr) continue;
    if (!found[k].present) {  // round the restored masters, as a step would
      std::vector<float> master(static_cast<std::size_t>(t.numel));
      copy_out(opt, master.data(), t.master, master.size() * 4);
      std::vector<std::uint16_t> model(master.size());
      for (std::size_t i = 0; i < master.size(); ++i) model[i] = to_bits16(opt.config().model_dtype, master[i]);
      copy_in(opt, t.model, model.data(), model.size() * 2);
    }
    ++k;
  }
  if (opt.backend() == Backend::cuda) {
    // Copies from pageable memory may land after cudaMemcpy returns, and steps on non-blocking
    // streams do not wait for the legacy stream they used: wait for them here.
    HALFSTEP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
  opt.load_state(state);
  return metadata;
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

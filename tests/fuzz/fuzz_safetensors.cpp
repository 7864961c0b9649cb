// Fuzz target: the safetensors header reader (src/safetensors_header.cpp), which every checkpoint
// load and checkpoint_metadata go through. Whatever the bytes, it either returns a header that
// passes every check, verified here on its own (known dtypes, whole bytes, each tensor aligned and
// the size of its shape, the tensors tiling the data section, the bounds on entries), which
// written back as JSON reads back the same; or it throws halfstep::Error (corrupt_state). It
// never crashes and throws nothing else. Each input is read twice: its first 8 bytes as the data
// section's length and the rest as the JSON header (so that mutations reach the JSON without
// breaking a length prefix), and as a whole file. Run with -max_len of a few MB
// (tools/run_fuzzers.sh: 4 MB) so that inputs can nest deeply.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_input.hpp"
#include "halfstep/error.hpp"
#include "safetensors_header.hpp"

using namespace halfstep;
using halfstep_fuzz::violated;

namespace {

const std::string kPath = "fuzz";

// The rules of an accepted header, checked independently of the reader.
void check_accepted(const detail::SafetensorsHeader& h, std::uint64_t data_bytes) {
  if (h.data_bytes != data_bytes) violated("the data section's length changed");
  if (h.tensors.size() > detail::kMaxTensors || h.metadata.size() > detail::kMaxMetadataPairs) {
    violated("an accepted header holds more entries than allowed");
  }
  for (const auto& [key, value] : h.metadata) {
    if (key.rfind("halfstep.", 0) == 0) violated("halfstep's own metadata key reached the caller's");
  }
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const auto& [name, e] : h.tensors) {
    if (name == "__metadata__") violated("__metadata__ accepted as a tensor");
    const unsigned bits = detail::dtype_bits(e.dtype);
    if (bits == 0) violated("an accepted tensor has an unknown dtype");
    const unsigned __int128 total = static_cast<unsigned __int128>(e.numel) * bits;
    if (total % 8 != 0) violated("an accepted tensor does not fill whole bytes");
    if (e.begin > e.end || e.end > data_bytes) violated("an accepted tensor lies outside the data section");
    if (static_cast<unsigned __int128>(e.end - e.begin) != total / 8) violated("an accepted tensor's bytes differ from its shape's");
    if (e.begin % std::max(1u, bits / 8) != 0) violated("an accepted tensor is misaligned");
    ranges.emplace_back(e.begin, e.end);
  }
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != at) violated("accepted tensors overlap or leave a gap");
    at = end;
  }
  if (at != data_bytes) violated("accepted tensors do not cover the data section");
}

// The shape a load reads of an entry: [] for a scalar, [numel] for one dimension, and past one
// the rest folded into the first: [numel / last, last] (block8 codes take their rows from it).
nlohmann::json folded_shape(const detail::SafetensorsEntry& e) {
  if (e.dims == 0) return nlohmann::json::array();
  if (e.dims == 1) return nlohmann::json::array({e.numel});
  return nlohmann::json::array({e.last == 0 ? 1 : e.numel / e.last, e.last});
}

// The accepted header written back as JSON (each shape folded to what a load reads) reads back
// the same.
void check_round_trip(const detail::SafetensorsHeader& h) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, e] : h.tensors) {
    if (e.dims == 0 ? e.numel != 1 : e.dims == 1 ? e.last != e.numel : e.last != 0 && e.numel % e.last != 0) {
      violated("an accepted tensor's last dimension does not divide its element count");
    }
    j[name] = {{"dtype", e.dtype}, {"shape", folded_shape(e)}, {"data_offsets", {e.begin, e.end}}};
  }
  nlohmann::json meta = h.metadata;
  if (!h.state.empty()) meta[detail::kStateKey] = detail::to_hex(h.state);
  j["__metadata__"] = meta;
  detail::SafetensorsHeader again;
  try {
    again = detail::parse_safetensors_header(j.dump(), h.data_bytes, kPath);
  } catch (const Error&) {
    violated("an accepted header written back is refused");
  }
  const auto same = [](const auto& a, const auto& b) {
    return a.first == b.first && a.second.dtype == b.second.dtype && a.second.numel == b.second.numel &&
           std::min<std::uint64_t>(a.second.dims, 2) == std::min<std::uint64_t>(b.second.dims, 2) &&
           a.second.last == b.second.last && a.second.begin == b.second.begin && a.second.end == b.second.end;
  };
  if (again.metadata != h.metadata || again.state != h.state ||
      !std::equal(again.tensors.begin(), again.tensors.end(), h.tensors.begin(), h.tensors.end(), same)) {
    violated("an accepted header written back reads back otherwise");
  }
}

template <class Read>
void check(Read read, std::uint64_t data_bytes_if_accepted) {
  detail::SafetensorsHeader h;
  try {
    h = read();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::corrupt_state) violated("the header reader threw an Error that is not corrupt_state");
    return;
  } catch (...) {
    violated("the header reader threw something other than halfstep::Error");
  }
  check_accepted(h, data_bytes_if_accepted);
  check_round_trip(h);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (size >= 8) {
    std::uint64_t data_bytes = 0;
    std::memcpy(&data_bytes, data, 8);  // little-endian, as in a file
    check([&] { return detail::parse_safetensors_header(bytes.substr(8), data_bytes, kPath); }, data_bytes);
  }
  std::uint64_t header_bytes = 0;
  for (std::size_t i = 0; i < 8 && i < size; ++i) header_bytes |= static_cast<std::uint64_t>(data[i]) << (8 * i);
  const std::uint64_t file_data = size >= 8 && header_bytes <= size - 8 ? size - 8 - header_bytes : 0;
  check(
      [&] {
        std::istringstream file{std::string(bytes)};
        return detail::read_safetensors_header(file, kPath);
      },
      file_data);
  return 0;
}

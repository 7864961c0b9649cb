// Internal: a safetensors file's header read as input. The 8-byte length, the JSON and every
// entry are checked: each field bounded, the tensors' byte ranges checked against each other and
// against the file, and anything else refused with halfstep::Error (ErrorKind::corrupt_state)
// naming the tensor or field and the rule. Host code only, without CUDA, so that the fuzz target
// (tests/fuzz) builds it as it is.
#pragma once

#include <cstdint>
#include <istream>
#include <map>
#include <string>
#include <string_view>

namespace halfstep::detail {

/// The metadata key of the optimizer state (save_state, hex-encoded) and of the writer's version.
inline constexpr const char* kStateKey = "halfstep.optimizer_state";
inline constexpr const char* kVersionKey = "halfstep.version";

/// The largest header read: Python's safetensors package refuses longer ones.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
/// Containers nested deeper than this in the header are refused before they are read. A
/// safetensors header needs three levels (the header, an entry, its shape); the rest is room for
/// fields other writers may add to an entry (which are skipped).
inline constexpr int kMaxHeaderDepth = 8;
/// At most this many tensors, and this many metadata pairs. Everything else a header holds is
/// bounded by kMaxHeaderBytes: a shape of any rank is folded into its element count as it is read
/// (overflow refused) and not kept, and names and values are kept once each. These two bound what
/// the entries cost to keep beyond their text (a map node each): 2^20 tensors is a model of
/// 262,144 parameter tensors (masters, two moments, model copy), far beyond any real one, and
/// callers' metadata is a handful of pairs.
inline constexpr std::size_t kMaxTensors = std::size_t{1} << 20;
inline constexpr std::size_t kMaxMetadataPairs = std::size_t{1} << 16;

/// One tensor of the header: its dtype code ("F32", "BF16", ...), element count and bytes
/// [begin, end) of the data section.
struct SafetensorsEntry {
  std::string dtype;
  std::uint64_t numel = 0;
  std::uint64_t dims = 0, last = 0;  // the shape's length and its last size (0 for a scalar)
  std::uint64_t begin = 0, end = 0;
};

/// A header that passed every check: the tensors' byte ranges, sorted by begin, tile the data
/// section exactly (no overlap, no gap, nothing after the last), each begins at a multiple of its
/// element size, and each holds exactly its shape's bytes.
struct SafetensorsHeader {
  std::uint64_t header_bytes = 0;  ///< the JSON's length; the data section starts at 8 + this
  std::uint64_t data_bytes = 0;    ///< the data section's length
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  ///< the caller's pairs (keys not starting "halfstep.")
  std::string state;                            ///< halfstep.optimizer_state, decoded; empty if absent
};

/// Throws the corrupt_state Error "checkpoint PATH: WHY".
[[noreturn]] void corrupt(const std::string& path, const std::string& why);

/// Bits per element of a safetensors dtype code (the codes Python's safetensors package knows);
/// 0 for any other string.
unsigned dtype_bits(std::string_view code);

/// Parses and checks `text`, the JSON header of a file whose data section is `data_bytes` long.
/// Duplicate tensor names, metadata keys or entry fields are refused (a reader could take either).
SafetensorsHeader parse_safetensors_header(std::string_view text, std::uint64_t data_bytes, const std::string& path);

/// Reads the length, then the header, from the start of `in` (a whole file), and checks it as
/// parse_safetensors_header does, the data section being the rest of `in`.
SafetensorsHeader read_safetensors_header(std::istream& in, const std::string& path);

/// Lower-case hex digits of `bytes`, as the optimizer state is stored in the metadata.
std::string to_hex(std::string_view bytes);

}  // namespace halfstep::detail

// The safetensors header as input: read through nlohmann's SAX interface into the entries and
// metadata it must hold, every event checked as it comes, then the tensors' byte ranges checked
// against each other and against the file.
#include "safetensors_header.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "check.hpp"
#include "halfstep/error.hpp"

namespace halfstep::detail {

void corrupt(const std::string& path, const std::string& why) {
  throw Error(ErrorKind::corrupt_state, concat("checkpoint ", path, ": ", why));
}

unsigned dtype_bits(std::string_view code) {
  // The dtypes of Python's safetensors package (0.8), which refuses any other.
  static const std::pair<std::string_view, unsigned> kDTypes[] = {
      {"BOOL", 8}, {"F4", 4}, {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8}, {"I8", 8}, {"F8_E5M2", 8},
      {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"I16", 16}, {"U16", 16},
      {"F16", 16}, {"BF16", 16}, {"I32", 32}, {"U32", 32}, {"F32", 32}, {"C64", 64}, {"F64", 64},
      {"I64", 64}, {"U64", 64}};
  for (const auto& [name, bits] : kDTypes) {
    if (name == code) return bits;
  }
  return 0;
}

std::string to_hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

namespace {

using Json = nlohmann::json;

// A name, value or parser message from the file, cut for an error message: whatever the file
// holds, the message stays readable (a name may be up to the header's 100 MB).
std::string cut(std::string_view s) {
  constexpr std::size_t kShown = 200;
  if (s.size() <= kShown) return std::string(s);
  return concat(s.substr(0, kShown), "... (", s.size(), " bytes)");
}

std::string shown(std::string_view s) { return concat("'", cut(s), "'"); }

std::string from_hex(const std::string& path, const std::string& hex) {
  if (hex.size() % 2 != 0) corrupt(path, concat(kStateKey, " has an odd number of hex digits"));
  auto value = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    corrupt(path, concat(kStateKey, " holds '", cut(std::string_view(&c, 1)), "', not a hex digit"));
  };
  std::string out(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(value(hex[2 * i]) * 16 + value(hex[2 * i + 1]));
  return out;
}

// Builds the entries and metadata from nlohmann's SAX events and refuses anything a safetensors
// header cannot hold as soon as it is seen. No document tree is built (a tree of a crafted 100 MB
// header costs gigabytes, and nlohmann's ordered_json inserts keys in linear time), and nesting
// is refused at kMaxHeaderDepth: nlohmann's SAX parser itself is not recursive, so a header
// nested 300,000 deep costs a few events, not the stack.
class HeaderReader final : public nlohmann::json_sax<Json> {
 public:
  HeaderReader(std::map<std::string, SafetensorsEntry>& tensors, std::map<std::string, std::string>& metadata,
               const std::string& path)
      : tensors_(tensors), metadata_(metadata), path_(path) {}

  bool null() override { return scalar("null"); }
  bool boolean(bool) override { return scalar("a boolean"); }
  bool number_integer(number_integer_t) override { return scalar("a negative number"); }  // >= 0 is unsigned
  bool number_float(number_float_t, const string_t&) override { return scalar("a number with a fraction or exponent"); }
  bool binary(binary_t&) override { return scalar("binary data"); }  // not in JSON text

  bool number_unsigned(number_unsigned_t v) override {
    if (in() == In::shape) {  // folded into the element count as Python's checked product does
      if (v != 0 && entry_.numel > std::numeric_limits<std::uint64_t>::max() / v) {
        fail(concat("tensor ", shown(name_), ": the element count of its shape overflows 64 bits"));
      }
      entry_.numel *= v;
      ++entry_.dims;
      entry_.last = v;
      return true;
    }
    if (in() == In::offsets) {
      if (offsets_ == 2) fail(concat("tensor ", shown(name_), ": data_offsets is not [begin, end]"));
      (offsets_++ == 0 ? entry_.begin : entry_.end) = v;
      return true;
    }
    return scalar("a number");
  }

  bool string(string_t& s) override {
    if (in() == In::metadata) {
      metadata_.emplace(key_, std::move(s));
      return true;
    }
    if (in() == In::entry && field_ == Field::dtype) {
      if (dtype_bits(s) == 0) fail(concat("tensor ", shown(name_), ": dtype ", shown(s), " is not a safetensors dtype"));
      entry_.dtype = std::move(s);
      return true;
    }
    return scalar("a string");
  }

  bool start_object(std::size_t) override {
    enter();
    switch (in()) {
      case In::top: return open(In::root);
      case In::root: return open(name_ == "__metadata__" ? In::metadata : In::entry);
      case In::skipped: return open(In::skipped);
      case In::entry:
        if (field_ == Field::other) return open(In::skipped);
        break;
      default: break;
    }
    return scalar("an object");
  }

  bool start_array(std::size_t) override {
    enter();
    if (in() == In::skipped || (in() == In::entry && field_ == Field::other)) return open(In::skipped);
    if (in() == In::entry && field_ == Field::shape) {
      entry_.numel = 1;
      return open(In::shape);
    }
    if (in() == In::entry && field_ == Field::offsets) {
      offsets_ = 0;
      return open(In::offsets);
    }
    return scalar("a list");
  }

  bool key(string_t& k) override {
    if (in() == In::root) {
      if (k == "__metadata__") {
        if (seen_metadata_) fail("the header holds __metadata__ twice");
        seen_metadata_ = true;
      } else {
        if (tensors_.count(k) != 0) fail(concat("the header names tensor ", shown(k), " twice"));
        if (tensors_.size() == kMaxTensors) fail(concat("the header holds more than ", kMaxTensors, " tensors"));
        entry_ = SafetensorsEntry{};
        seen_ = 0;
      }
      name_ = std::move(k);
    } else if (in() == In::metadata) {
      if (metadata_.count(k) != 0) fail(concat("metadata ", shown(k), " appears twice"));
      if (metadata_.size() == kMaxMetadataPairs) fail(concat("the metadata holds more than ", kMaxMetadataPairs, " pairs"));
      key_ = std::move(k);
    } else if (in() == In::entry) {
      field_ = k == "dtype" ? Field::dtype : k == "shape" ? Field::shape : k == "data_offsets" ? Field::offsets : Field::other;
      if (field_ != Field::other) {
        const unsigned bit = 1u << static_cast<unsigned>(field_);
        if ((seen_ & bit) != 0) fail(concat("tensor ", shown(name_), " gives its ", k, " twice"));
        seen_ |= bit;
      }
    }
    return true;
  }

  bool end_object() override {
    const In closed = close();
    if (closed == In::entry) {
      if (seen_ != 7u) fail(concat("tensor ", shown(name_), " lacks dtype, shape or data_offsets"));
      tensors_.emplace(std::move(name_), std::move(entry_));
    }
    return true;
  }

  bool end_array() override {
    if (close() == In::offsets && offsets_ != 2) fail(concat("tensor ", shown(name_), ": data_offsets is not [begin, end]"));
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    fail(concat("the header is not JSON (", cut(e.what()), ")"));
  }

 private:
  enum class In { top, root, metadata, entry, shape, offsets, skipped };
  enum class Field : unsigned { dtype, shape, offsets, other };

  In in() const { return open_.empty() ? In::top : open_.back(); }

  [[noreturn]] void fail(const std::string& why) const { corrupt(path_, why); }

  // A container starts: refused past kMaxHeaderDepth, before anything of it is read.
  void enter() const {
    if (open_.size() == static_cast<std::size_t>(kMaxHeaderDepth)) {
      fail(concat("the header nests lists or objects deeper than ", kMaxHeaderDepth,
                  " levels (a safetensors header needs 3)"));
    }
  }
  bool open(In what) {
    open_.push_back(what);
    return true;
  }
  In close() {
    const In closed = in();
    open_.pop_back();  // nlohmann balances every end with a start
    return closed;
  }

  // A value the schema has no place for, unless it is inside a field that is skipped.
  bool scalar(const char* what) const {
    switch (in()) {
      case In::skipped: return true;
      case In::entry:
        if (field_ == Field::other) return true;
        if (field_ == Field::dtype) fail(concat("tensor ", shown(name_), ": dtype is ", what, ", not a string"));
        fail(concat("tensor ", shown(name_), ": ", field_ == Field::shape ? "shape" : "data_offsets", " is ", what,
                    ", not a list"));
      case In::shape: fail(concat("tensor ", shown(name_), ": shape holds ", what, ", not a size"));
      case In::offsets: fail(concat("tensor ", shown(name_), ": data_offsets is not [begin, end] (it holds ", what, ")"));
      case In::metadata: fail(concat("metadata ", shown(key_), " is ", what, ", not a string"));
      case In::root:
        if (name_ == "__metadata__") {
          if (std::string_view(what) == "null") return true;  // no metadata, as Python's package reads it
          fail(concat("__metadata__ is ", what, ", not an object"));
        }
        fail(concat("tensor ", shown(name_), " is ", what, ", not an object"));
      case In::top: break;
    }
    fail(concat("the header is ", what, ", not a JSON object"));
  }

  std::map<std::string, SafetensorsEntry>& tensors_;
  std::map<std::string, std::string>& metadata_;
  const std::string& path_;
  std::vector<In> open_;  // the open containers, innermost last: at most kMaxHeaderDepth
  std::string name_;      // the header's key being read: a tensor's name or __metadata__
  std::string key_;       // the metadata key being read
  SafetensorsEntry entry_;
  Field field_ = Field::other;
  unsigned seen_ = 0;  // the entry's fields read so far, one bit each
  int offsets_ = 0;    // the data_offsets read so far
  bool seen_metadata_ = false;
};

// The tensors' byte ranges: each the size of its shape, inside the data section and aligned to
// its element; sorted by begin, they must tile the data section exactly, as Python's safetensors
// package requires (it refuses overlaps, gaps and bytes after the last tensor). Checked for every
// entry, also those a loader does not take: a file whose bytes are shared or unaccounted for was
// not written by a safetensors writer, and which of two overlapping tensors is right is unknown.
void check_ranges(const std::map<std::string, SafetensorsEntry>& tensors, std::uint64_t data_bytes,
                  const std::string& path) {
  constexpr const char* kRule =
      "(safetensors: the tensors' bytes, in order of their offsets, cover the data section exactly, "
      "without overlap or gap)";
  std::vector<const std::pair<const std::string, SafetensorsEntry>*> order;
  order.reserve(tensors.size());
  for (const auto& named : tensors) {
    const auto& [name, e] = named;
    const std::uint64_t bits = dtype_bits(e.dtype);
    if (e.numel > std::numeric_limits<std::uint64_t>::max() / bits) {
      corrupt(path, concat("tensor ", shown(name), ": its ", e.numel, " elements of ", e.dtype, " overflow 64 bits"));
    }
    if (e.numel * bits % 8 != 0) {
      corrupt(path, concat("tensor ", shown(name), ": its ", e.numel, " elements of ", e.dtype, " do not fill whole bytes"));
    }
    const std::uint64_t bytes = e.numel * bits / 8;
    if (e.begin > e.end || e.end - e.begin != bytes) {
      corrupt(path, concat("tensor ", shown(name), ": data_offsets [", e.begin, ", ", e.end, ") do not hold the ", bytes,
                           " bytes of its shape"));
    }
    if (e.end > data_bytes) {
      corrupt(path, concat("tensor ", shown(name), ": bytes [", e.begin, ", ", e.end, ") do not lie inside the file's ",
                           data_bytes, " data bytes (truncated?)"));
    }
    const std::uint64_t align = bits >= 8 ? bits / 8 : 1;
    if (e.begin % align != 0) {
      corrupt(path, concat("tensor ", shown(name), ": its bytes begin at ", e.begin, ", not a multiple of the ", align,
                           "-byte size of ", e.dtype));
    }
    order.push_back(&named);
  }
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::make_pair(a->second.begin, a->second.end) < std::make_pair(b->second.begin, b->second.end);
  });
  std::uint64_t at = 0;
  const std::pair<const std::string, SafetensorsEntry>* previous = nullptr;
  for (const auto* named : order) {
    const SafetensorsEntry& e = named->second;
    if (e.begin < at) {
      corrupt(path, concat("tensor ", shown(named->first), ": bytes [", e.begin, ", ", e.end, ") overlap tensor ",
                           shown(previous->first), "'s [", previous->second.begin, ", ", previous->second.end, ") ", kRule));
    }
    if (e.begin > at) {
      corrupt(path, concat("bytes [", at, ", ", e.begin, ") of the data section, before tensor ", shown(named->first),
                           ", belong to no tensor ", kRule));
    }
    at = e.end;
    previous = named;
  }
  if (at != data_bytes) {
    corrupt(path, concat("bytes [", at, ", ", data_bytes, ") of the data section, after the last tensor, belong to no tensor ",
                         kRule));
  }
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::string_view text, std::uint64_t data_bytes, const std::string& path) {
  if (text.size() > kMaxHeaderBytes) {
    corrupt(path, concat("the header's ", text.size(), " bytes pass the limit of ", kMaxHeaderBytes));
  }
  SafetensorsHeader h;
  h.header_bytes = text.size();
  h.data_bytes = data_bytes;
  std::map<std::string, std::string> metadata;  // every pair, halfstep's own included
  HeaderReader reader(h.tensors, metadata, path);
  // parse_error throws, so a false return (which nlohmann gives only after one) cannot happen.
  (void)Json::sax_parse(text.begin(), text.end(), &reader, Json::input_format_t::json, /*strict=*/true);
  check_ranges(h.tensors, data_bytes, path);
  for (auto& [key, value] : metadata) {
    if (key == kStateKey) {
      h.state = from_hex(path, value);
    } else if (key.rfind("halfstep.", 0) != 0) {
      h.metadata.emplace(key, std::move(value));
    }
  }
  return h;
}

SafetensorsHeader read_safetensors_header(std::istream& in, const std::string& path) {
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  in.seekg(0);
  if (!in || end < 0) throw Error(ErrorKind::invalid_argument, concat("checkpoint ", path, ": cannot read it"));
  const auto file_bytes = static_cast<std::uint64_t>(end);
  if (file_bytes < 8) corrupt(path, concat("truncated: ", file_bytes, " bytes, a header length needs 8"));
  unsigned char size[8];
  in.read(reinterpret_cast<char*>(size), 8);
  std::uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= static_cast<std::uint64_t>(size[i]) << (8 * i);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8) {
    corrupt(path, concat("the header length ", header_bytes, " does not fit a file of ", file_bytes,
                         " bytes (is it a safetensors file?)"));
  }
  std::string text(static_cast<std::size_t>(header_bytes), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (!in) corrupt(path, "reading the header failed");
  return parse_safetensors_header(text, file_bytes - 8 - header_bytes, path);
}

}  // namespace halfstep::detail

// Checkpoint format, version 1:
//   "HSTP" | u32 version | u32 payload bytes | payload | u32 CRC-32 of everything before it
// Payload, little-endian: scale (f32 bits), good_steps, hysteresis_left (i32), overflows, growths,
// backoffs (i64), spike mean, var (f64 bits), seen, spikes, consecutive (i64), step, attempts (i64).
#include "halfstep/checkpoint.hpp"

#include <array>
#include <cstring>

#include "check.hpp"

namespace halfstep {
namespace {

constexpr char kMagic[4] = {'H', 'S', 'T', 'P'};
constexpr std::size_t kHeaderBytes = 12;
constexpr std::size_t kPayloadBytes = 4 + 4 + 4 + 3 * 8 + 2 * 8 + 3 * 8 + 2 * 8;
constexpr std::size_t kTotalBytes = kHeaderBytes + kPayloadBytes + 4;

std::uint32_t crc32(const unsigned char* data, std::size_t n) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

class Writer {
 public:
  void bytes(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
  }
  void i32(std::int32_t v) { u32(static_cast<std::uint32_t>(v)); }
  void i64(std::int64_t v) { u64(static_cast<std::uint64_t>(v)); }
  void f32(float v) {
    std::uint32_t b;
    std::memcpy(&b, &v, 4);
    u32(b);
  }
  void f64(double v) {
    std::uint64_t b;
    std::memcpy(&b, &v, 8);
    u64(b);
  }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(byte()) << (8 * i);
    return v;
  }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(byte()) << (8 * i);
    return v;
  }
  std::int32_t i32() { return static_cast<std::int32_t>(u32()); }
  std::int64_t i64() { return static_cast<std::int64_t>(u64()); }
  float f32() {
    const std::uint32_t b = u32();
    float v;
    std::memcpy(&v, &b, 4);
    return v;
  }
  double f64() {
    const std::uint64_t b = u64();
    double v;
    std::memcpy(&v, &b, 8);
    return v;
  }

 private:
  unsigned char byte() { return static_cast<unsigned char>(in_[pos_++]); }
  std::string_view in_;
  std::size_t pos_ = 0;
};

[[noreturn]] void corrupt(const std::string& why) {
  throw Error(ErrorKind::corrupt_state, "halfstep state checkpoint: " + why);
}

}  // namespace

std::string encode_state(const OptimizerState& s) {
  Writer w;
  w.bytes(kMagic, 4);
  w.u32(kStateFormatVersion);
  w.u32(static_cast<std::uint32_t>(kPayloadBytes));
  w.f32(s.scaler.scale);
  w.i32(s.scaler.good_steps);
  w.i32(s.scaler.hysteresis_left);
  w.i64(s.scaler.overflows);
  w.i64(s.scaler.growths);
  w.i64(s.scaler.backoffs);
  w.f64(s.spike.mean);
  w.f64(s.spike.var);
  w.i64(s.spike.seen);
  w.i64(s.spike.spikes);
  w.i64(s.spike.consecutive);
  w.i64(s.step);
  w.i64(s.attempts);
  const auto* data = reinterpret_cast<const unsigned char*>(w.str().data());
  w.u32(crc32(data, w.str().size()));
  return w.str();
}

OptimizerState decode_state(std::string_view bytes) {
  if (bytes.size() < kHeaderBytes) {
    corrupt(detail::concat("truncated: ", bytes.size(), " bytes, a header needs ", kHeaderBytes));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) corrupt("wrong magic (not a halfstep state)");
  Reader header(bytes.substr(4));
  const std::uint32_t version = header.u32();
  if (version != kStateFormatVersion) {
    corrupt(detail::concat("unknown format version ", version, " (this build reads ",
                           kStateFormatVersion, ")"));
  }
  const std::uint32_t payload = header.u32();
  if (payload != kPayloadBytes || bytes.size() != kTotalBytes) {
    corrupt(detail::concat("size mismatch: ", bytes.size(), " bytes with a declared payload of ",
                           payload, ", version ", version, " has ", kTotalBytes, " bytes"));
  }
  Reader tail(bytes.substr(kTotalBytes - 4));
  const std::uint32_t stored = tail.u32();
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  if (crc32(data, kTotalBytes - 4) != stored) corrupt("checksum mismatch (corrupted bytes)");

  Reader r(bytes.substr(kHeaderBytes));
  OptimizerState s;
  s.scaler.scale = r.f32();
  s.scaler.good_steps = r.i32();
  s.scaler.hysteresis_left = r.i32();
  s.scaler.overflows = r.i64();
  s.scaler.growths = r.i64();
  s.scaler.backoffs = r.i64();
  s.spike.mean = r.f64();
  s.spike.var = r.f64();
  s.spike.seen = r.i64();
  s.spike.spikes = r.i64();
  s.spike.consecutive = r.i64();
  s.step = r.i64();
  s.attempts = r.i64();
  return s;
}

void load_state(OptimizerState& target, std::string_view bytes, const StepConfig& config) {
  const OptimizerState decoded = decode_state(bytes);
  try {
    validate_state(decoded, config);
  } catch (const Error& e) {
    throw Error(ErrorKind::corrupt_state,
                std::string("halfstep state checkpoint does not fit this StepConfig: ") + e.what());
  }
  target = decoded;
}

}  // namespace halfstep

// Checkpoint format, version 2:
//   "HSTP" | u32 version | u32 payload bytes | payload | u32 CRC-32 (zlib) of everything before it
// Payload, little-endian, floating-point fields as their bits:
//   state   scale f32, good_steps i32, hysteresis_left i32, overflows i64, growths i64,
//           backoffs i64, spike mean f64, var f64, seen i64, spikes i64, consecutive i64,
//           step i64, attempts i64
//   config  grad_dtype u8, model_dtype u8, max_grad_norm f32,
//           scaler: init_scale f32, growth_factor f32, backoff_factor f32, growth_interval i32,
//           hysteresis i32, consecutive_hysteresis u8, min_scale f32, max_scale f32,
//           headroom_growth u8, headroom_margin_log2 f32,
//           spike: enabled u8, z_threshold f32, ema_beta f32, warmup_steps i32, action u8,
//           min_std f32, max_consecutive i32,
//           groups u32, then per group: lr f32, beta1 f32, beta2 f32, eps f32, weight_decay f32,
//           decoupled_weight_decay u8, bias_correction u8
#include "halfstep/checkpoint.hpp"

#include <zlib.h>

#include <cstring>

#include "check.hpp"

namespace halfstep {
namespace {

constexpr char kMagic[4] = {'H', 'S', 'T', 'P'};
constexpr std::size_t kHeaderBytes = 12;
constexpr std::size_t kStateBytes = 4 + 4 + 4 + 3 * 8 + 2 * 8 + 3 * 8 + 2 * 8;
constexpr std::size_t kConfigBytes = 1 + 1 + 4 + (4 * 3 + 4 + 4 + 1 + 4 + 4 + 1 + 4) +
                                     (1 + 4 + 4 + 4 + 1 + 4 + 4) + 4;
constexpr std::size_t kGroupBytes = 5 * 4 + 2;
/// More groups than any model has; bounds what a corrupt count can make the decoder allocate.
constexpr std::uint32_t kMaxGroups = 1u << 20;

std::uint32_t checksum(const char* data, std::size_t n) {
  uLong c = crc32(0L, Z_NULL, 0);
  while (n > 0) {  // zlib takes uInt lengths
    const uInt part = static_cast<uInt>(n > (1u << 30) ? (1u << 30) : n);
    c = crc32(c, reinterpret_cast<const Bytef*>(data), part);
    data += part;
    n -= part;
  }
  return static_cast<std::uint32_t>(c);
}

class Writer {
 public:
  void bytes(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  void u8(std::uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
  }
  void i32(std::int32_t v) { u32(static_cast<std::uint32_t>(v)); }
  void i64(std::int64_t v) { u64(static_cast<std::uint64_t>(v)); }
  void boolean(bool v) { u8(v ? 1 : 0); }
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

[[noreturn]] void corrupt(const std::string& why) {
  throw Error(ErrorKind::corrupt_state, "halfstep state checkpoint: " + why);
}

// Reads fields from a range whose length was checked before.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  std::uint8_t u8() { return byte(); }
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
  bool boolean(const char* field) {
    const std::uint8_t b = byte();
    if (b > 1) corrupt(detail::concat(field, " must be 0 or 1, got ", static_cast<int>(b)));
    return b == 1;
  }
  DType dtype(const char* field) {
    const std::uint8_t b = byte();
    if (b != static_cast<std::uint8_t>(DType::f16) && b != static_cast<std::uint8_t>(DType::bf16)) {
      corrupt(detail::concat(field, " must be f16 or bf16, got code ", static_cast<int>(b)));
    }
    return static_cast<DType>(b);
  }
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

// Floats compared by value, so that the same number written two ways matches; NaN never occurs in
// a valid config.
template <class T>
void must_match(const T& saved, const T& here, const std::string& field, const char* why) {
  if (!(saved == here)) {
    throw Error(ErrorKind::corrupt_state,
                detail::concat("halfstep state checkpoint does not fit this StepConfig: ", field,
                               " is ", saved, " in the checkpoint and ", here, " here (", why, ")"));
  }
}

}  // namespace

std::string encode_state(const OptimizerState& s, const StepConfig& c) {
  c.validate();
  validate_state(s, c);
  detail::require(c.groups.size() <= kMaxGroups, "a checkpoint holds at most ", kMaxGroups,
                  " groups, got ", c.groups.size());
  Writer w;
  w.bytes(kMagic, 4);
  w.u32(kStateFormatVersion);
  w.u32(static_cast<std::uint32_t>(kStateBytes + kConfigBytes + kGroupBytes * c.groups.size()));
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
  w.u8(static_cast<std::uint8_t>(c.grad_dtype));
  w.u8(static_cast<std::uint8_t>(c.model_dtype));
  w.f32(c.max_grad_norm);
  w.f32(c.scaler.init_scale);
  w.f32(c.scaler.growth_factor);
  w.f32(c.scaler.backoff_factor);
  w.i32(c.scaler.growth_interval);
  w.i32(c.scaler.hysteresis);
  w.boolean(c.scaler.consecutive_hysteresis);
  w.f32(c.scaler.min_scale);
  w.f32(c.scaler.max_scale);
  w.boolean(c.scaler.headroom_growth);
  w.f32(c.scaler.headroom_margin_log2);
  w.boolean(c.spike.enabled);
  w.f32(c.spike.z_threshold);
  w.f32(c.spike.ema_beta);
  w.i32(c.spike.warmup_steps);
  w.u8(c.spike.action == SpikeConfig::Action::skip ? 1 : 0);
  w.f32(c.spike.min_std);
  w.i32(c.spike.max_consecutive);
  w.u32(static_cast<std::uint32_t>(c.groups.size()));
  for (const AdamWConfig& g : c.groups) {
    w.f32(g.lr);
    w.f32(g.beta1);
    w.f32(g.beta2);
    w.f32(g.eps);
    w.f32(g.weight_decay);
    w.boolean(g.decoupled_weight_decay);
    w.boolean(g.bias_correction);
  }
  w.u32(checksum(w.str().data(), w.str().size()));
  return w.str();
}

SavedState decode_state(std::string_view bytes) {
  if (bytes.size() < kHeaderBytes + 4) {
    corrupt(detail::concat("truncated: ", bytes.size(), " bytes, a header and checksum need ",
                           kHeaderBytes + 4));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) corrupt("wrong magic (not a halfstep state)");
  Reader header(bytes.substr(4));
  const std::uint32_t version = header.u32();
  if (version != kStateFormatVersion) {
    corrupt(detail::concat("unknown format version ", version, " (this build reads version ",
                           kStateFormatVersion,
                           version == 1 ? "; version 1 recorded no configuration and cannot be checked" : "",
                           ")"));
  }
  const std::uint32_t payload = header.u32();
  if (payload < kStateBytes + kConfigBytes || bytes.size() != kHeaderBytes + std::size_t{payload} + 4) {
    corrupt(detail::concat("size mismatch: ", bytes.size(), " bytes with a declared payload of ",
                           payload, " (a checkpoint is the payload + ", kHeaderBytes + 4, " bytes)"));
  }
  const std::size_t body = kHeaderBytes + payload;
  if (checksum(bytes.data(), body) != Reader(bytes.substr(body)).u32()) {
    corrupt("checksum mismatch (corrupted bytes)");
  }
  const std::uint64_t n_groups = Reader(bytes.substr(kHeaderBytes + kStateBytes + kConfigBytes - 4)).u32();
  if (n_groups > kMaxGroups || payload != kStateBytes + kConfigBytes + kGroupBytes * n_groups) {
    corrupt(detail::concat("the payload of ", payload, " bytes does not hold ", n_groups, " groups"));
  }

  Reader r(bytes.substr(kHeaderBytes));
  SavedState out;
  OptimizerState& s = out.state;
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
  StepConfig& c = out.config;
  c.grad_dtype = r.dtype("grad_dtype");
  c.model_dtype = r.dtype("model_dtype");
  c.max_grad_norm = r.f32();
  c.scaler.init_scale = r.f32();
  c.scaler.growth_factor = r.f32();
  c.scaler.backoff_factor = r.f32();
  c.scaler.growth_interval = r.i32();
  c.scaler.hysteresis = r.i32();
  c.scaler.consecutive_hysteresis = r.boolean("ScalerConfig.consecutive_hysteresis");
  c.scaler.min_scale = r.f32();
  c.scaler.max_scale = r.f32();
  c.scaler.headroom_growth = r.boolean("ScalerConfig.headroom_growth");
  c.scaler.headroom_margin_log2 = r.f32();
  c.spike.enabled = r.boolean("SpikeConfig.enabled");
  c.spike.z_threshold = r.f32();
  c.spike.ema_beta = r.f32();
  c.spike.warmup_steps = r.i32();
  c.spike.action = r.boolean("SpikeConfig.action") ? SpikeConfig::Action::skip : SpikeConfig::Action::log;
  c.spike.min_std = r.f32();
  c.spike.max_consecutive = r.i32();
  (void)r.u32();  // the group count, read above
  c.groups.assign(static_cast<std::size_t>(n_groups), AdamWConfig{});
  for (AdamWConfig& g : c.groups) {
    g.lr = r.f32();
    g.beta1 = r.f32();
    g.beta2 = r.f32();
    g.eps = r.f32();
    g.weight_decay = r.f32();
    g.decoupled_weight_decay = r.boolean("AdamWConfig.decoupled_weight_decay");
    g.bias_correction = r.boolean("AdamWConfig.bias_correction");
  }
  try {  // the recorded configuration must be valid, and the state one it could have produced
    c.validate();
    validate_state(s, c);
  } catch (const Error& e) {
    corrupt(e.what());
  }
  return out;
}

SavedState load_state(std::string_view bytes, const StepConfig& config) {
  SavedState saved = decode_state(bytes);
  const StepConfig& a = saved.config;
  const StepConfig& b = config;
  must_match(a.groups.size(), b.groups.size(), "the number of groups", "each group has its own state");
  must_match(std::string(dtype_name(a.grad_dtype)), std::string(dtype_name(b.grad_dtype)), "grad_dtype", "the scaler's state is for its range");
  must_match(std::string(dtype_name(a.model_dtype)), std::string(dtype_name(b.model_dtype)), "model_dtype", "the model copies are in it");
  const char* scaler_why = "the scaler's state follows its rules";
  must_match(a.scaler.growth_factor, b.scaler.growth_factor, "ScalerConfig.growth_factor", scaler_why);
  must_match(a.scaler.backoff_factor, b.scaler.backoff_factor, "ScalerConfig.backoff_factor", scaler_why);
  must_match(a.scaler.growth_interval, b.scaler.growth_interval, "ScalerConfig.growth_interval", scaler_why);
  must_match(a.scaler.hysteresis, b.scaler.hysteresis, "ScalerConfig.hysteresis", scaler_why);
  must_match(a.scaler.consecutive_hysteresis, b.scaler.consecutive_hysteresis,
             "ScalerConfig.consecutive_hysteresis", scaler_why);
  must_match(a.scaler.min_scale, b.scaler.min_scale, "ScalerConfig.min_scale", scaler_why);
  must_match(a.scaler.max_scale, b.scaler.max_scale, "ScalerConfig.max_scale", scaler_why);
  must_match(a.scaler.headroom_growth, b.scaler.headroom_growth, "ScalerConfig.headroom_growth", scaler_why);
  must_match(a.scaler.headroom_margin_log2, b.scaler.headroom_margin_log2,
             "ScalerConfig.headroom_margin_log2", scaler_why);
  const char* spike_why = "the spike statistics follow its rules";
  must_match(a.spike.enabled, b.spike.enabled, "SpikeConfig.enabled", spike_why);
  must_match(a.spike.z_threshold, b.spike.z_threshold, "SpikeConfig.z_threshold", spike_why);
  must_match(a.spike.ema_beta, b.spike.ema_beta, "SpikeConfig.ema_beta", spike_why);
  must_match(a.spike.warmup_steps, b.spike.warmup_steps, "SpikeConfig.warmup_steps", spike_why);
  must_match(a.spike.action == SpikeConfig::Action::skip, b.spike.action == SpikeConfig::Action::skip,
             "SpikeConfig.action is skip", spike_why);
  must_match(a.spike.min_std, b.spike.min_std, "SpikeConfig.min_std", spike_why);
  must_match(a.spike.max_consecutive, b.spike.max_consecutive, "SpikeConfig.max_consecutive", spike_why);
  for (std::size_t g = 0; g < a.groups.size(); ++g) {
    const std::string at = detail::concat("groups[", g, "].");
    const char* why = "the moments and bias correction were built with it";
    must_match(a.groups[g].beta1, b.groups[g].beta1, at + "beta1", why);
    must_match(a.groups[g].beta2, b.groups[g].beta2, at + "beta2", why);
    must_match(a.groups[g].decoupled_weight_decay, b.groups[g].decoupled_weight_decay,
               at + "decoupled_weight_decay", why);
    must_match(a.groups[g].bias_correction, b.groups[g].bias_correction, at + "bias_correction", why);
    // The restored learning rate meets this config's weight decay.
    AdamWConfig restored = b.groups[g];
    restored.lr = a.groups[g].lr;
    try {
      restored.validate();
    } catch (const Error& e) {
      throw Error(ErrorKind::corrupt_state,
                  detail::concat("halfstep state checkpoint does not fit this StepConfig: the restored ",
                                 at, "lr with this weight_decay: ", e.what()));
    }
  }
  try {
    validate_state(saved.state, config);
  } catch (const Error& e) {
    throw Error(ErrorKind::corrupt_state,
                std::string("halfstep state checkpoint does not fit this StepConfig: ") + e.what());
  }
  return saved;
}

}  // namespace halfstep

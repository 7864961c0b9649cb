// Checkpoint format, version 4 (versions 2 and 3 are read too):
//   "HSTP" | u32 version | u32 payload bytes | payload | u32 CRC-32 (zlib) of everything before it
// Payload, little-endian: the fields listed in visit_state, then those in visit_config, the number
// of groups (u32), then each group's fields as listed in visit_group, in that order, each as its
// type says (Wire below): float and double as their f32 and f64 bits, int32_t and int64_t as i32
// and i64, and bool, DType and the spike action as one byte (0 or 1; the DType's code; 1: skip).
// A field new in a version is absent from older ones (Field::since); reading those, it keeps its
// default.
#include "halfstep/checkpoint.hpp"

#include <zlib.h>

#include <cstring>
#include <string>
#include <utility>

#include "check.hpp"

namespace halfstep {
namespace {

constexpr char kMagic[4] = {'H', 'S', 'T', 'P'};
constexpr std::size_t kHeaderBytes = 12;
constexpr std::size_t kGroupCountBytes = 4;
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

[[noreturn]] void corrupt(const std::string& why) {
  throw Error(ErrorKind::corrupt_state, "halfstep state checkpoint: " + why);
}

// How each type of field is stored: its width in bytes and the bits written; `valid` and `rule`
// say which bits a decoder accepts. A field of any other type needs its encoding here first.
template <class T>
struct Wire;

// Numbers: their bits, as they are in memory.
template <class T, class Bits>
struct AsBits {
  static constexpr std::size_t bytes = sizeof(Bits);
  static std::uint64_t bits(T x) {
    Bits b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  }
  static T value(std::uint64_t stored) {
    const auto b = static_cast<Bits>(stored);
    T x;
    std::memcpy(&x, &b, sizeof x);
    return x;
  }
  static bool valid(std::uint64_t) { return true; }
  static constexpr const char* rule = "";
};
template <>
struct Wire<float> : AsBits<float, std::uint32_t> {};
template <>
struct Wire<double> : AsBits<double, std::uint64_t> {};
template <>
struct Wire<std::int32_t> : AsBits<std::int32_t, std::uint32_t> {};
template <>
struct Wire<std::int64_t> : AsBits<std::int64_t, std::uint64_t> {};
template <>
struct Wire<std::uint64_t> : AsBits<std::uint64_t, std::uint64_t> {};

// A one-byte enumeration whose codes 0 .. count - 1 are valid.
template <class E, std::uint64_t kCount>
struct AsCode {
  static constexpr std::size_t bytes = 1;
  static std::uint64_t bits(E x) { return static_cast<std::uint8_t>(x); }
  static E value(std::uint64_t stored) { return static_cast<E>(stored); }
  static bool valid(std::uint64_t stored) { return stored < kCount; }
  static constexpr const char* rule = " is not a known code, got ";
};
template <>
struct Wire<MasterFormat> : AsCode<MasterFormat, 3> {};
template <>
struct Wire<MomentFormat> : AsCode<MomentFormat, 3> {};
template <>
struct Wire<Rounding> : AsCode<Rounding, 2> {};

template <>
struct Wire<bool> {
  static constexpr std::size_t bytes = 1;
  static std::uint64_t bits(bool x) { return x ? 1 : 0; }
  static bool value(std::uint64_t stored) { return stored == 1; }
  static bool valid(std::uint64_t stored) { return stored <= 1; }
  static constexpr const char* rule = " must be 0 or 1, got ";
};

template <>
struct Wire<DType> {
  static constexpr std::size_t bytes = 1;
  static std::uint64_t bits(DType x) { return static_cast<std::uint8_t>(x); }
  static DType value(std::uint64_t stored) { return static_cast<DType>(stored); }
  static bool valid(std::uint64_t stored) {
    return stored == static_cast<std::uint8_t>(DType::f16) || stored == static_cast<std::uint8_t>(DType::bf16) ||
           stored == static_cast<std::uint8_t>(DType::f32);
  }
  static constexpr const char* rule = " must be f16, bf16 or f32, got code ";
};

template <>
struct Wire<SpikeConfig::Action> : Wire<bool> {  // the flag "is skip"
  static std::uint64_t bits(SpikeConfig::Action x) {
    return Wire<bool>::bits(x == SpikeConfig::Action::skip);
  }
  static SpikeConfig::Action value(std::uint64_t stored) {
    return Wire<bool>::value(stored) ? SpikeConfig::Action::skip : SpikeConfig::Action::log;
  }
};

/// One recorded field: its name in error messages and, if the checkpoint's value must equal the
/// configuration's when loading, why (SavedState lists these). State fields are never compared:
/// validate_state checks them against the configuration instead.
struct Field {
  const char* name;
  const char* must_match_because = nullptr;
  std::uint32_t since = 2;  ///< the first format version that holds it
};

/// The versions decode_state reads.
constexpr std::uint32_t kOldestVersion = 2;

// What a checkpoint holds, each field once, in the order of the format. Each function calls
// v.field(Field, x...) with that field of every object given: the Writer and the Sizer visit one
// object, the Reader the one it fills, the Matcher the checkpoint's and the one to load into. A
// new option is a line here (and a new format version).

template <class V, class... S>
void visit_state(V& v, S&... s) {
  v.field({"ScalerState.scale"}, s.scaler.scale...);
  v.field({"ScalerState.good_steps"}, s.scaler.good_steps...);
  v.field({"ScalerState.hysteresis_left"}, s.scaler.hysteresis_left...);
  v.field({"ScalerState.overflows"}, s.scaler.overflows...);
  v.field({"ScalerState.growths"}, s.scaler.growths...);
  v.field({"ScalerState.backoffs"}, s.scaler.backoffs...);
  v.field({"SpikeState.mean"}, s.spike.mean...);
  v.field({"SpikeState.var"}, s.spike.var...);
  v.field({"SpikeState.seen"}, s.spike.seen...);
  v.field({"SpikeState.spikes"}, s.spike.spikes...);
  v.field({"SpikeState.consecutive"}, s.spike.consecutive...);
  v.field({"OptimizerState.step"}, s.step...);
  v.field({"OptimizerState.attempts"}, s.attempts...);
}

// Everything of a StepConfig but its groups (and host_driven, which is not recorded).
template <class V, class... C>
void visit_config(V& v, C&... c) {
  v.field({"grad_dtype", "the scaler's state is for its range"}, c.grad_dtype...);
  v.field({"model_dtype", "the model copies are in it"}, c.model_dtype...);
  v.field({"compute_dtype", nullptr, 3}, c.compute_dtype...);
  v.field({"max_grad_norm"}, c.max_grad_norm...);
  const char* scaler = "the scaler's state follows its rules";
  v.field({"ScalerConfig.init_scale"}, c.scaler.init_scale...);
  v.field({"ScalerConfig.growth_factor", scaler}, c.scaler.growth_factor...);
  v.field({"ScalerConfig.backoff_factor", scaler}, c.scaler.backoff_factor...);
  v.field({"ScalerConfig.growth_interval", scaler}, c.scaler.growth_interval...);
  v.field({"ScalerConfig.hysteresis", scaler}, c.scaler.hysteresis...);
  v.field({"ScalerConfig.consecutive_hysteresis", scaler}, c.scaler.consecutive_hysteresis...);
  v.field({"ScalerConfig.min_scale", scaler}, c.scaler.min_scale...);
  v.field({"ScalerConfig.max_scale", scaler}, c.scaler.max_scale...);
  v.field({"ScalerConfig.headroom_growth", scaler}, c.scaler.headroom_growth...);
  v.field({"ScalerConfig.headroom_margin_log2", scaler}, c.scaler.headroom_margin_log2...);
  const char* spike = "the spike statistics follow its rules";
  v.field({"SpikeConfig.enabled", spike}, c.spike.enabled...);
  v.field({"SpikeConfig.z_threshold", spike}, c.spike.z_threshold...);
  v.field({"SpikeConfig.ema_beta", spike}, c.spike.ema_beta...);
  v.field({"SpikeConfig.warmup_steps", spike}, c.spike.warmup_steps...);
  v.field({"SpikeConfig.action", spike}, c.spike.action...);
  v.field({"SpikeConfig.min_std", spike}, c.spike.min_std...);
  v.field({"SpikeConfig.max_consecutive", spike}, c.spike.max_consecutive...);
  // How the state was held: informative (the buffers are another's to convert: load_checkpoint,
  // halfstep.torch; the rounding is the loading optimizer's own choice), and the seed, which
  // load_state restores so that stochastic rounding draws the bits it would have drawn.
  v.field({"StateFormat.master", nullptr, 4}, c.state.master...);
  v.field({"StateFormat.exp_avg", nullptr, 4}, c.state.exp_avg...);
  v.field({"StateFormat.exp_avg_sq", nullptr, 4}, c.state.exp_avg_sq...);
  v.field({"StateFormat.rounding", nullptr, 4}, c.state.rounding...);
  v.field({"StateFormat.seed", nullptr, 4}, c.state.seed...);
}

// One group. The names are completed by the visitor: "AdamWConfig.beta1" when decoding,
// "groups[1].beta1" when matching.
// lr, the betas, eps, weight_decay and step_offset are the values in force at save time (set_lr,
// set_group), which load_state restores; the two flags are fixed at construction.
template <class V, class... G>
void visit_group(V& v, G&... g) {
  const char* built = "the moments and bias correction were built with it";
  v.field({"lr"}, g.lr...);
  v.field({"beta1"}, g.beta1...);
  v.field({"beta2"}, g.beta2...);
  v.field({"eps"}, g.eps...);
  v.field({"weight_decay"}, g.weight_decay...);
  v.field({"decoupled_weight_decay", built}, g.decoupled_weight_decay...);
  v.field({"bias_correction", built}, g.bias_correction...);
  v.field({"step_offset", nullptr, 3}, g.step_offset...);
}

class Sizer {
 public:
  explicit Sizer(std::uint32_t version) : version_(version) {}
  template <class T>
  void field(const Field& f, const T&) {
    if (f.since <= version_) bytes += Wire<T>::bytes;
  }
  std::size_t bytes = 0;

 private:
  std::uint32_t version_;
};

// The payload's parts: the state, the configuration and the group count; then each group.
struct Sizes {
  std::size_t fixed;
  std::size_t group;
};

Sizes sizes(std::uint32_t version) {
  const OptimizerState state{};
  const StepConfig config;
  Sizer fixed(version), group(version);
  visit_state(fixed, state);
  visit_config(fixed, config);
  visit_group(group, config.groups.front());
  return Sizes{fixed.bytes + kGroupCountBytes, group.bytes};
}

class Writer {
 public:
  template <class T>
  void field(const Field&, const T& x) {  // every field: it writes the current version
    put(Wire<T>::bits(x), Wire<T>::bytes);
  }
  void bytes(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  void u32(std::uint32_t v) { put(v, 4); }
  std::string& str() { return out_; }

 private:
  void put(std::uint64_t bits, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xFFu));
  }
  std::string out_;
};

// Reads fields from a range whose length was checked before; a field's bits that its type does
// not accept are refused, naming it (prefixed with `scope`).
class Reader {
 public:
  explicit Reader(std::string_view in, std::uint32_t version = kStateFormatVersion) : in_(in), version_(version) {}
  template <class T>
  void field(const Field& f, T& x) {
    if (f.since > version_) return;  // not in this version: x keeps its default
    const std::uint64_t stored = take(Wire<T>::bytes);
    if (!Wire<T>::valid(stored)) corrupt(detail::concat(scope, f.name, Wire<T>::rule, stored));
    x = Wire<T>::value(stored);
  }
  std::uint32_t u32() { return static_cast<std::uint32_t>(take(4)); }
  const char* scope = "";

 private:
  std::uint64_t take(std::size_t n) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) {
      v |= std::uint64_t{static_cast<unsigned char>(in_[pos_++])} << (8 * i);
    }
    return v;
  }
  std::string_view in_;
  std::size_t pos_ = 0;
  std::uint32_t version_;
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

// Compares a checkpoint's configuration with the one it is loaded into, field by field.
class Matcher {
 public:
  explicit Matcher(std::string scope) : scope_(std::move(scope)) {}
  template <class T>
  void field(const Field& f, const T& saved, const T& here) {
    if (f.must_match_because != nullptr) {
      must_match(shown(saved), shown(here), scope_ + f.name, f.must_match_because);
    }
  }
  void field(const Field& f, SpikeConfig::Action saved, SpikeConfig::Action here) {
    if (f.must_match_because != nullptr) {  // as recorded: the flag "is skip"
      using Flag = Wire<SpikeConfig::Action>;
      must_match(Flag::bits(saved), Flag::bits(here), scope_ + f.name + " is skip", f.must_match_because);
    }
  }

 private:
  template <class T>
  static const T& shown(const T& x) {
    return x;
  }
  static std::string_view shown(DType d) { return dtype_name(d); }
  static std::string_view shown(MasterFormat f) { return master_format_name(f); }
  static std::string_view shown(MomentFormat f) { return moment_format_name(f); }
  static std::string_view shown(Rounding r) { return rounding_name(r); }
  std::string scope_;
};

}  // namespace

std::string encode_state(const OptimizerState& s, const StepConfig& c) {
  c.validate();
  validate_state(s, c);
  detail::require(c.groups.size() <= kMaxGroups, "a checkpoint holds at most ", kMaxGroups,
                  " groups, got ", c.groups.size());
  Writer w;
  w.bytes(kMagic, 4);
  w.u32(kStateFormatVersion);
  const Sizes size = sizes(kStateFormatVersion);
  w.u32(static_cast<std::uint32_t>(size.fixed + size.group * c.groups.size()));
  visit_state(w, s);
  visit_config(w, c);
  w.u32(static_cast<std::uint32_t>(c.groups.size()));
  for (const AdamWConfig& g : c.groups) visit_group(w, g);
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
  if (version < kOldestVersion || version > kStateFormatVersion) {
    corrupt(detail::concat("unknown format version ", version, " (this build reads versions ", kOldestVersion,
                           " to ", kStateFormatVersion,
                           version == 1 ? "; version 1 recorded no configuration and cannot be checked" : "",
                           ")"));
  }
  const Sizes size = sizes(version);
  const std::uint32_t payload = header.u32();
  if (payload < size.fixed || bytes.size() != kHeaderBytes + std::size_t{payload} + 4) {
    corrupt(detail::concat("size mismatch: ", bytes.size(), " bytes with a declared payload of ",
                           payload, " (a checkpoint is the payload + ", kHeaderBytes + 4, " bytes)"));
  }
  const std::size_t body = kHeaderBytes + payload;
  if (checksum(bytes.data(), body) != Reader(bytes.substr(body)).u32()) {
    corrupt("checksum mismatch (corrupted bytes)");
  }
  const std::uint64_t n_groups = Reader(bytes.substr(kHeaderBytes + size.fixed - kGroupCountBytes)).u32();
  if (n_groups > kMaxGroups || payload != size.fixed + size.group * n_groups) {
    corrupt(detail::concat("the payload of ", payload, " bytes does not hold ", n_groups, " groups"));
  }

  Reader r(bytes.substr(kHeaderBytes), version);
  SavedState out;
  out.version = version;
  visit_state(r, out.state);
  visit_config(r, out.config);
  (void)r.u32();  // the group count, read above
  out.config.groups.assign(static_cast<std::size_t>(n_groups), AdamWConfig{});
  r.scope = "AdamWConfig.";
  for (AdamWConfig& g : out.config.groups) visit_group(r, g);
  try {  // the recorded configuration must be valid, and the state one it could have produced
    out.config.validate();
    validate_state(out.state, out.config);
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
  Matcher everything_else("");
  visit_config(everything_else, a, b);
  for (std::size_t g = 0; g < a.groups.size(); ++g) {
    const std::string at = detail::concat("groups[", g, "].");
    Matcher group(at);
    visit_group(group, a.groups[g], b.groups[g]);
  }
  try {
    StepConfig restored = config;  // with the groups' values the checkpoint restores
    restored.groups = saved.config.groups;
    validate_state(saved.state, restored);
  } catch (const Error& e) {
    throw Error(ErrorKind::corrupt_state,
                std::string("halfstep state checkpoint does not fit this StepConfig: ") + e.what());
  }
  return saved;
}

}  // namespace halfstep

// The CPU reference step: scalar loops in double precision, one pass to measure, one to apply.
// It states every rule of the step's arithmetic on its own — the sum of squares, the decision, the
// update, the storage formats — and the GPU suite compares the kernels against it. What it shares
// with the kernels is the totals record's format (decode_totals, the fingerprint): an interface
// between ranks and backends, not step arithmetic.
#include "halfstep/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "halfstep/distributed.hpp"

#include "block8.hpp"
#include "check.hpp"
#include "halfstep/error.hpp"
#include "reference_impl.hpp"
#include "step_math.hpp"

namespace halfstep {
namespace {

constexpr double kFp32Max = static_cast<double>(std::numeric_limits<float>::max());

// A gradient element as stored: its bit pattern (16 or 32 bits) and its value.
struct Element {
  std::uint32_t bits;
  double value;
};

Element grad_element(const ParamTensor& p, DType dtype, std::int64_t i) {
  if (dtype == DType::f32) {
    const float x = static_cast<const float*>(p.grad)[i];
    std::uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return {bits, static_cast<double>(x)};
  }
  const std::uint16_t bits = static_cast<const std::uint16_t*>(p.grad)[i];
  return {bits, from_bits16(dtype, bits)};
}

double grad_value(const ParamTensor& p, DType dtype, std::int64_t i) { return grad_element(p, dtype, i).value; }

// The value of the magnitude bits of a pattern of the gradient format (its sign bit ignored).
double magnitude(DType dtype, std::uint32_t bits) {
  const std::uint32_t m = bits & format_bits(dtype).magnitude();
  if (dtype == DType::f32) {
    float x;
    std::memcpy(&x, &m, sizeof x);
    return static_cast<double>(x);
  }
  return from_bits16(dtype, static_cast<std::uint16_t>(m));
}

// A 16-bit pattern is finite unless its exponent field is all ones.
bool finite_bits16(DType dtype, std::uint16_t bits) {
  const std::uint32_t exponent = format_bits(dtype).exponent;
  return (bits & exponent) != exponent;
}

// The applied steps group `h` has taken, this one included, when the optimizer takes its t-th: the
// ones since it joined (step_offset steps in), and at least this one.
std::int64_t steps_of_group(const AdamWConfig& h, std::int64_t t) { return std::max<std::int64_t>(t - h.step_offset, 1); }

// Why an update from the largest unscaled, clipped gradient g_max could not be finite in fp32,
// before anything is written; `t` is the applied-step counter the step would have.
SkipReason update_range(const StepConfig& config, double g_max, std::int64_t t) {
  for (const AdamWConfig& h : config.groups) {
    const double lr = h.lr;
    if (!(lr >= 0.0 && lr <= kFp32Max)) return SkipReason::invalid_learning_rate;
    if (h.decoupled_weight_decay && lr * static_cast<double>(h.weight_decay) >= 1.0) {
      return SkipReason::invalid_learning_rate;
    }
  }
  if (!(g_max <= kFp32Max)) return SkipReason::gradient_exceeds_fp32;
  for (const AdamWConfig& h : config.groups) {
    if ((1.0 - static_cast<double>(h.beta2)) * g_max * g_max > kFp32Max) {
      return SkipReason::second_moment_exceeds_fp32;
    }
    // beta1^t as the device's verdict computes it (detail::power: the same bits everywhere), so
    // that both reach the same verdict bit for bit.
    const double bc1 = h.bias_correction ? 1.0 - detail::power(static_cast<double>(h.beta1), steps_of_group(h, t)) : 1.0;
    if (!std::isfinite(static_cast<float>(static_cast<double>(h.lr) / bc1))) {
      return SkipReason::step_size_exceeds_fp32;
    }
  }
  return SkipReason::none;
}

// ---- the state formats, as stored (the reference's own codec: halfstep/state.hpp states them) ----

float float_of_bits(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
std::uint32_t bits_of_float(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Stochastic rounding's random bits, as docs/design.md states them: splitmix64's finalizer over
// (seed, applied step), then the tensor's id; murmur3's 32-bit finalizer over the element's index
// in the whole tensor, mixed with that key.
std::uint64_t splitmix(std::uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
std::uint32_t murmur_finalizer(std::uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
std::uint32_t random_bits(std::uint64_t seed, std::int64_t step, std::uint32_t tensor_id, std::int64_t index) {
  const std::uint64_t k_step = splitmix(seed ^ splitmix(static_cast<std::uint64_t>(step)));
  const std::uint64_t k_tensor = splitmix(k_step + std::uint64_t{tensor_id} * 0x9E3779B97F4A7C15ull);
  const std::uint64_t i = static_cast<std::uint64_t>(index);
  const std::uint32_t mixed = static_cast<std::uint32_t>(i) ^ static_cast<std::uint32_t>(k_tensor) ^
                              ((static_cast<std::uint32_t>(i >> 32) + static_cast<std::uint32_t>(k_tensor >> 32)) *
                               0x9E3779B9u);
  return murmur_finalizer(mixed);
}
// The weight's random bits of an element without a master, from the element's bits r: r
// multiplied by 0x9E3779B9 (mod 2^32), xor r's upper half.
std::uint32_t weight_random_bits(std::uint32_t r) {
  return static_cast<std::uint32_t>(std::uint64_t{r} * 0x9E3779B9u) ^ (r >> 16);
}

// A moment's value as stored.
double moment_value(MomentFormat format, const void* buffer, std::int64_t i) {
  if (format == MomentFormat::bf16) return from_bf16_bits(static_cast<const std::uint16_t*>(buffer)[i]);
  return static_cast<const float*>(buffer)[i];
}
// The fp32 result `x` as the moment format stores it (16 random bits for stochastic rounding);
// false if that is not finite.
bool encode_moment(MomentFormat format, Rounding rounding, float x, std::uint32_t random, std::uint32_t& out) {
  if (!std::isfinite(x)) return false;
  if (format == MomentFormat::f32) {
    out = bits_of_float(x);
    return true;
  }
  const std::uint32_t b = bits_of_float(x);
  out = rounding == Rounding::stochastic ? (b + (random & 0xFFFFu)) >> 16 : to_bf16_bits(static_cast<double>(x));
  return finite_bits16(DType::bf16, static_cast<std::uint16_t>(out));
}
void store_moment(MomentFormat format, void* buffer, std::int64_t i, std::uint32_t bits) {
  if (format == MomentFormat::bf16) {
    static_cast<std::uint16_t*>(buffer)[i] = static_cast<std::uint16_t>(bits);
  } else {
    static_cast<float*>(buffer)[i] = float_of_bits(bits);
  }
}

// A master's value as stored: fp32, or the bf16 model copy and its int16 remainder. A pair a step
// never stores whose join is not a number (±0 written over a negative remainder) is the model
// copy's value; a model copy that is not finite stays so.
double master_value(const StepConfig& config, const ParamTensor& p, std::int64_t i) {
  if (config.state.master == MasterFormat::none) return from_bits16(DType::bf16, static_cast<const std::uint16_t*>(p.model)[i]);
  if (config.state.master == MasterFormat::bf16_remainder) {
    const std::uint16_t model = static_cast<const std::uint16_t*>(p.model)[i];
    const float joined = float_of_bits(join_master(model, static_cast<const std::int16_t*>(p.master)[i]));
    const double own = from_bits16(DType::bf16, model);
    return std::isfinite(joined) || !std::isfinite(own) ? static_cast<double>(joined) : own;
  }
  return static_cast<const float*>(p.master)[i];
}

// One element's AdamW step in double, and what it would store: its master (with a bf16 model
// copy, canonical_master's value), the model copy (the stored fp32 master rounded once; with
// remainders half of it; without a master the fp32 result with the state's rounding), and the
// new moments before their storage formats round them. `finite`: the master and model copy are.
struct ElementStep {
  double m = 0.0, v = 0.0;
  float w = 0.0f;
  std::uint16_t model = 0;
  std::int16_t rest = 0;
  std::uint32_t random = 0;  // the element's draw for stochastic rounding (0 to nearest)
  bool finite = false;
};

struct TensorStep {
  const ParamTensor& p;
  const StepConfig& config;
  double coef, lr, beta1, beta2, eps, wd, bc1, bc2;
  bool decoupled, remainder, no_master, canonical;
  std::uint32_t id;
  std::int64_t t;

  TensorStep(const ParamTensor& tensor, std::size_t index, const StepConfig& c, double clip_coef, std::int64_t step)
      : p(tensor), config(c), coef(clip_coef), t(step) {
    const AdamWConfig& h = c.groups[static_cast<std::size_t>(tensor.group)];
    lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, wd = h.weight_decay;
    bc1 = h.bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(steps_of_group(h, step))) : 1.0;
    bc2 = h.bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(steps_of_group(h, step))) : 1.0;
    decoupled = h.decoupled_weight_decay;
    remainder = c.state.master == MasterFormat::bf16_remainder;
    no_master = c.state.master == MasterFormat::none;
    canonical = tensor.model != nullptr && c.model_dtype == DType::bf16 && !no_master;
    id = tensor.tensor_id != 0 ? tensor.tensor_id : static_cast<std::uint32_t>(index + 1);
  }

  // Element i from its stored moments m0, v0.
  ElementStep element(std::int64_t i, double m0, double v0) const {
    const StateFormat& f = config.state;
    ElementStep e;
    double w = master_value(config, p, i);
    double g = grad_value(p, config.grad_dtype, i) * coef;
    if (decoupled) {
      w = w * (1.0 - lr * wd);  // decoupled decay shrinks the weight itself
    } else {
      g = g + wd * w;  // classic L2: the decay joins the gradient
    }
    e.m = beta1 * m0 + (1.0 - beta1) * g;
    e.v = beta2 * v0 + (1.0 - beta2) * g * g;
    w = w - (lr / bc1) * e.m / (std::sqrt(e.v) / std::sqrt(bc2) + eps);
    e.w = static_cast<float>(w);
    e.random = f.rounding == Rounding::stochastic ? random_bits(f.seed, t, id, p.offset + i) : 0;
    e.finite = std::isfinite(e.w);
    if (e.finite && canonical) e.w = float_of_bits(canonical_master(bits_of_float(e.w)));
    e.model = e.finite && p.model != nullptr ? to_bits16(config.model_dtype, e.w) : 0;
    if (e.finite && no_master && f.rounding == Rounding::stochastic) {
      e.model = static_cast<std::uint16_t>((bits_of_float(e.w) + (weight_random_bits(e.random) & 0xFFFFu)) >> 16);
    }
    if (e.finite && p.model != nullptr) e.finite = finite_bits16(config.model_dtype, e.model);
    std::uint16_t split_model = 0;
    if (e.finite && remainder) e.finite = split_master(bits_of_float(e.w), split_model, e.rest) && split_model == e.model;
    return e;
  }

  // Stores element i's master and model copy.
  void store_weight(std::int64_t i, const ElementStep& e) const {
    if (remainder) {
      static_cast<std::int16_t*>(p.master)[i] = e.rest;
    } else if (!no_master) {
      static_cast<float*>(p.master)[i] = e.w;
    }
    if (p.model != nullptr) static_cast<std::uint16_t*>(p.model)[i] = e.model;
  }
};

// AdamW on every element of one tensor (the `index`-th of the step) with moments of one value per
// element (fp32, bf16; fp32 for a tensor that keeps wide moments under block8). `coef` is clip / S:
// it unscales and clips at once. An element whose stored values would not all be finite keeps its
// old ones; returns how many did.
std::int64_t apply_elements(const TensorStep& s, MomentFormat exp_avg, MomentFormat exp_avg_sq) {
  const ParamTensor& p = s.p;
  const Rounding rounding = s.config.state.rounding;
  std::int64_t held = 0;
  for (std::int64_t i = 0; i < p.numel; ++i) {
    const ElementStep e = s.element(i, moment_value(exp_avg, p.exp_avg, i), moment_value(exp_avg_sq, p.exp_avg_sq, i));
    std::uint32_t m_bits = 0, v_bits = 0;
    const bool finite = e.finite && encode_moment(exp_avg, rounding, static_cast<float>(e.m), e.random, m_bits) &&
                        encode_moment(exp_avg_sq, rounding, static_cast<float>(e.v), e.random >> 16, v_bits);
    if (!finite) {
      ++held;
      continue;
    }
    s.store_weight(i, e);
    store_moment(exp_avg, p.exp_avg, i, m_bits);
    store_moment(exp_avg_sq, p.exp_avg_sq, i, v_bits);
  }
  return held;
}

// AdamW on a tensor with block8 moments, a block at a time: each element decodes exp_avg =
// map·scale and exp_avg_sq = (map·scale)², steps in double; then each block stores its new
// exp_avg (to nearest) and sqrt(exp_avg_sq) (with the state's rounding, bits 16-31 of the
// element's draw, a positive root never as 0) as codes with new scales (the codec of
// kernels/block8.hpp: the format's definition, as to_bf16_bits is bf16's). A block any of whose
// new values would not be finite keeps everything it held; returns the elements held.
std::int64_t apply_blocks(const TensorStep& s, const MomentBlocks& b) {
  const ParamTensor& p = s.p;
  const detail::Block8Geometry g = detail::block8_geometry_of(p);
  const bool stochastic = s.config.state.rounding == Rounding::stochastic;
  auto* m_codes = static_cast<std::uint8_t*>(p.exp_avg);
  auto* v_codes = static_cast<std::uint8_t*>(p.exp_avg_sq);
  std::int64_t held = 0;
  std::int64_t i = 0;  // the block's first element in the piece
  for (std::int64_t k = 0; k < b.blocks; ++k) {
    const int n = static_cast<int>(g.block_size(b.first + k));
    ElementStep e[detail::kBlock8];
    float m[detail::kBlock8], root[detail::kBlock8];
    std::uint32_t random[detail::kBlock8];
    bool finite = true;
    for (int j = 0; j < n; ++j) {
      const double m0 = detail::decode8(detail::kSignedCodec8, m_codes[i + j], p.exp_avg_scale[k]);
      const double r0 = detail::decode8(detail::kUnsignedCodec8, v_codes[i + j], p.exp_avg_sq_scale[k]);
      e[j] = s.element(i + j, m0, r0 * r0);
      m[j] = static_cast<float>(e[j].m);
      root[j] = static_cast<float>(std::sqrt(e[j].v));
      random[j] = e[j].random;
      finite = finite && e[j].finite && std::isfinite(m[j]) && std::isfinite(static_cast<float>(e[j].v));
    }
    std::uint8_t mc[detail::kBlock8], vc[detail::kBlock8];
    float ms = 0.0f, vs = 0.0f;
    if (finite) {
      finite = detail::encode_block8(detail::kSignedCodec8, m, n, false, random, 0, false, mc, ms) &&
               detail::encode_block8(detail::kUnsignedCodec8, root, n, stochastic, random, 16, true, vc, vs);
    }
    if (!finite) {
      held += n;
    } else {
      for (int j = 0; j < n; ++j) {
        s.store_weight(i + j, e[j]);
        m_codes[i + j] = mc[j];
        v_codes[i + j] = vc[j];
      }
      p.exp_avg_scale[k] = ms;
      p.exp_avg_sq_scale[k] = vs;
    }
    i += n;
  }
  return held;
}

// AdamW on every element of one tensor in its state formats.
std::int64_t apply_tensor(const ParamTensor& p, std::size_t index, const StepConfig& config, double coef, std::int64_t t) {
  const TensorStep s(p, index, config, coef, t);
  const MomentBlocks b = moment_blocks(config, p);
  if (b.quantized) return apply_blocks(s, b);
  if (config.state.exp_avg == MomentFormat::block8) return apply_elements(s, MomentFormat::f32, MomentFormat::f32);
  return apply_elements(s, config.state.exp_avg, config.state.exp_avg_sq);
}

// ---- Σg², exactly -------------------------------------------------------------------------
// Every finite fp16, bf16 or fp32 value is k · 2^e with k an integer below 2^24 and e >= -149, so
// every square is k² (below 2^48) times a power of two no smaller than 2^-298: an integer in units
// of 2^-298. SquareSum adds those integers; nothing is rounded until rounded_sum.

// An unsigned integer in base 2^32, least significant digit first.
using Digits = std::vector<std::uint32_t>;

// Carries 64-bit words into base-2^32 digits (two more digits than words: the last carry can
// reach 2^33).
Digits carry_digits(const std::uint64_t* words, std::size_t n) {
  Digits d(n + 2, 0);
  std::uint64_t carry = 0;  // below 2^32 + 2^32: adding a word below 2^64 could wrap, so split
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t low = (words[i] & 0xFFFFFFFFu) + carry;
    d[i] = static_cast<std::uint32_t>(low);
    carry = (low >> 32) + (words[i] >> 32);
  }
  d[n] = static_cast<std::uint32_t>(carry);
  d[n + 1] = static_cast<std::uint32_t>(carry >> 32);
  return d;
}

class SquareSum {
 public:
  // Adds the square of the finite nonzero value k · 2^e.
  void add(std::uint64_t k, int e) {
    const int shift = 2 * e + 298;  // the square in units of 2^-298
    const unsigned __int128 placed = static_cast<unsigned __int128>(k * k) << (shift % 32);  // < 2^79
    const auto at = static_cast<std::size_t>(shift / 32);
    for (std::size_t j = 0; j < 3; ++j) words_[at + j] += static_cast<std::uint64_t>(placed >> (32 * j)) & 0xFFFFFFFFu;
    if (++adds_ == (std::uint64_t{1} << 30)) {  // every word stays below 2^63
      carry();
      adds_ = 0;
    }
  }
  Digits digits() const { return carry_digits(words_.data(), words_.size()); }

 private:
  void carry() {
    const Digits d = digits();
    for (std::size_t i = 0; i < words_.size(); ++i) words_[i] = d[i];  // the sum is below 2^640
  }
  std::vector<std::uint64_t> words_ = std::vector<std::uint64_t>(StepTotals::kSumLimbs + 2, 0);
  std::uint64_t adds_ = 0;
};

// A finite nonzero magnitude as k · 2^e (k an integer): the stored significand and exponent.
void significand_exponent(DType dtype, std::uint32_t magnitude, std::uint64_t& k, int& e) {
  const FormatBits f = format_bits(dtype);
  const int fraction_bits = f.fraction_bits;
  const int bias = f.bias();
  const int field = static_cast<int>(magnitude >> fraction_bits);
  const std::uint64_t fraction = magnitude & ((1u << fraction_bits) - 1u);
  k = field == 0 ? fraction : fraction | (std::uint64_t{1} << fraction_bits);
  e = std::max(field, 1) - bias - fraction_bits;
}

int compare(const Digits& a, const Digits& b) {
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = n; i-- > 0;) {
    const std::uint32_t x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    if (x != y) return x < y ? -1 : 1;
  }
  return 0;
}

// a - b for a >= b.
Digits subtract(const Digits& a, const Digits& b) {
  Digits d(a.size(), 0);
  std::int64_t borrow = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    std::int64_t v = static_cast<std::int64_t>(a[i]) - (i < b.size() ? b[i] : 0) - borrow;
    borrow = v < 0 ? 1 : 0;
    if (v < 0) v += std::int64_t{1} << 32;
    d[i] = static_cast<std::uint32_t>(v);
  }
  return d;
}

// v · 2^shift.
Digits shifted(std::uint64_t v, int shift) {
  Digits d(static_cast<std::size_t>(shift / 32) + 4, 0);
  const std::uint64_t lo = v << (shift % 32);
  const std::uint64_t hi = shift % 32 == 0 ? 0 : v >> (64 - shift % 32);
  d[static_cast<std::size_t>(shift / 32)] = static_cast<std::uint32_t>(lo);
  d[static_cast<std::size_t>(shift / 32) + 1] = static_cast<std::uint32_t>(lo >> 32);
  d[static_cast<std::size_t>(shift / 32) + 2] = static_cast<std::uint32_t>(hi);
  return d;
}

}  // namespace

namespace detail {

// The double nearest to the record's Σg² (ties to the even significand). An approximation first,
// then the exact choice among its neighbours: each candidate c = m · 2^e (e >= -299 here) and the
// sum are compared as integers in units of 2^-352.
double reference_sum_of_squares(const StepTotals& totals) {
  const Digits sum = carry_digits(totals.sum, StepTotals::kSumLimbs);
  double approx = 0.0;
  for (std::size_t i = sum.size(); i-- > 0;) approx = approx * 4294967296.0 + sum[i];
  approx = std::ldexp(approx, -298);
  if (approx == 0.0) return 0.0;
  Digits exact(sum.size() + 2, 0);  // sum · 2^54
  for (std::size_t i = 0; i < sum.size(); ++i) {
    const Digits part = shifted(sum[i], static_cast<int>(32 * i) + 54);
    std::uint64_t carry = 0;
    for (std::size_t j = 0; j < exact.size(); ++j) {
      const std::uint64_t v = std::uint64_t{exact[j]} + (j < part.size() ? part[j] : 0) + carry;
      exact[j] = static_cast<std::uint32_t>(v);
      carry = v >> 32;
    }
  }
  double best = approx;
  Digits best_gap;
  bool have = false;
  double c = approx;
  for (int k = 0; k < 8; ++k) c = std::nextafter(c, 0.0);  // the approximation is within 2 ulps
  for (int k = 0; k < 17; ++k, c = std::nextafter(c, HUGE_VAL)) {
    int e = 0;
    const double m = std::frexp(c, &e);  // c = m · 2^e, m in [0.5, 1)
    const auto significand = static_cast<std::uint64_t>(std::ldexp(m, 53));
    const Digits candidate = shifted(significand, e - 53 + 352);
    const Digits gap = compare(exact, candidate) >= 0 ? subtract(exact, candidate) : subtract(candidate, exact);
    const int order = have ? compare(gap, best_gap) : -1;
    if (order < 0 || (order == 0 && (significand & 1u) == 0)) {
      best = c;
      best_gap = gap;
      have = true;
    }
  }
  return best;
}

StepTotals reference_measure(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                             std::int32_t rank, std::vector<std::int64_t>* nonfinite_per_tensor) {
  return reference_measure(tensors, config, rank, nonfinite_per_tensor, ScaleInputs{}, config.scaler.init_scale, 0);
}

StepTotals reference_measure(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                             std::int32_t rank, std::vector<std::int64_t>* nonfinite_per_tensor,
                             const ScaleInputs& scale, float own_scale, std::uint64_t grads_key) {
  if (nonfinite_per_tensor) nonfinite_per_tensor->assign(tensors.size(), 0);
  SquareSum squares;
  std::uint64_t nonfinite = 0, subnormal = 0, zero = 0, numel = 0;
  std::uint32_t max_bits = 0;
  std::int64_t first_bad = -1;
  // Subnormal: nonzero and below the smallest normal of the format the gradients were computed in.
  const double min_normal = format_info(measured_dtype(config)).min_normal;
  const std::uint32_t sign = format_bits(config.grad_dtype).sign;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    if (p.grad == nullptr) continue;  // no gradient this step: not measured
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < p.numel; ++i) {
      const Element g = grad_element(p, config.grad_dtype, i);
      if (!std::isfinite(g.value)) {
        ++bad;
        continue;
      }
      const std::uint32_t magnitude = g.bits & (sign - 1u);
      max_bits = std::max(max_bits, magnitude);  // patterns of |x| order as the values do
      if (p.duplicate) continue;
      if (g.value == 0.0) {
        ++zero;
        continue;
      }
      if (std::fabs(g.value) < min_normal) ++subnormal;
      std::uint64_t k;
      int e;
      significand_exponent(config.grad_dtype, magnitude, k, e);
      squares.add(k, e);
    }
    if (bad > 0 && first_bad < 0) first_bad = static_cast<std::int64_t>(t);
    if (nonfinite_per_tensor) (*nonfinite_per_tensor)[t] = bad;
    nonfinite += static_cast<std::uint64_t>(bad);
    if (!p.duplicate) numel += static_cast<std::uint64_t>(p.numel);
  }
  StepTotals r{};
  const Digits digits = squares.digits();
  for (int i = 0; i < StepTotals::kSumLimbs; ++i) r.sum[i] = digits[static_cast<std::size_t>(i)];
  r.sum[StepTotals::kSumLimbs] = nonfinite;
  r.sum[StepTotals::kSumLimbs + 1] = subnormal;
  r.sum[StepTotals::kSumLimbs + 2] = zero;
  r.sum[StepTotals::kSumLimbs + 3] = numel;
  r.max[0] = max_bits;
  if (first_bad >= 0) {  // the documented key: lower ranks, then lower tensors, are larger
    r.max[1] = (std::uint64_t{0xFFFFFFFFu - static_cast<std::uint32_t>(rank)} << 32) |
               (0xFFFFFFFFu - static_cast<std::uint32_t>(first_bad));
  }
  std::vector<detail::GroupParams> params;
  std::vector<float> lr;
  for (const AdamWConfig& h : config.groups) {
    params.push_back(detail::group_params(h));
    lr.push_back(h.lr);
  }
  detail::set_fingerprint(r, detail::hyperparameter_fingerprint(params.data(), lr.data(),
                                                                static_cast<std::int32_t>(params.size()),
                                                                config.max_grad_norm, scale, own_scale, grads_key));
  return r;
}

StepReport reference_finish(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                            OptimizerState& state, const StepTotals& totals, const ScaleInputs& in) {
  StepReport r{};
  state.attempts = count_up(state.attempts);
  r.attempt = state.attempts;
  // The scale the gradients were computed with: the optimizer's own, whose scaler then moves, or
  // an external scaler's, which moves its own.
  const bool external = in.external != 0, unscaled = in.unscaled != 0;
  const float scale = external ? in.external_scale : state.scaler.scale;
  r.scale_used = scale;
  r.reason = SkipReason::none;

  // The record, decoded.
  const std::size_t n = StepTotals::kSumLimbs;
  r.nonfinite_count = static_cast<std::int64_t>(totals.sum[n]);
  r.subnormal_count = static_cast<std::int64_t>(totals.sum[n + 1]);
  r.zero_count = static_cast<std::int64_t>(totals.sum[n + 2]);
  r.numel = static_cast<std::int64_t>(totals.sum[n + 3]);
  const double max_abs = magnitude(config.grad_dtype, static_cast<std::uint32_t>(totals.max[0]));
  r.first_nonfinite_rank = -1;
  r.first_nonfinite_tensor = -1;
  if (totals.max[1] != 0) {
    r.first_nonfinite_rank = static_cast<std::int32_t>(0xFFFFFFFFu - (totals.max[1] >> 32));
    r.first_nonfinite_tensor = static_cast<std::int32_t>(0xFFFFFFFFu - (totals.max[1] & 0xFFFFFFFFu));
  }
  const double sum_sq = reference_sum_of_squares(totals);  // Σg² of the gradients, rounded once
  // Gradients already divided by the loss scale (mark_unscaled) were computed scaled: their
  // headroom is that of their values times the scale, and they are unscaled by 1.
  const double S = unscaled ? 1.0 : scale;
  const double scaled_max = unscaled ? max_abs * scale : max_abs;
  r.max_abs_scaled = static_cast<float>(scaled_max);
  r.headroom_log2 =
      scaled_max > 0.0
          ? static_cast<float>(portable_log2(static_cast<double>(format_info(measured_dtype(config)).max) / scaled_max))
          : std::numeric_limits<float>::infinity();

  auto finish = [&](Outcome outcome, SkipReason reason) {
    r.outcome = outcome;
    r.reason = reason;
    r.step = state.step;
    r.scale_next = external ? scale : state.scaler.scale;
    return r;
  };
  // The record's own rules, as the kernels check them (a record is a format, not step math):
  // one that no reduction gives, or ranks with different hyperparameters, is never applied.
  const detail::Totals checked = detail::decode_totals(totals, config.grad_dtype);
  if (checked.fault != detail::TotalsFault::none || checked.rank_refused || !checked.hyperparameters_agree) {
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    r.clip_coef = std::numeric_limits<float>::quiet_NaN();
    return finish(Outcome::skipped_inconsistent, detail::inconsistent_reason(checked));
  }
  if (r.nonfinite_count > 0 || in.found_inf != 0.0f) {  // overflow: nothing is written, the scaler backs off
    if (!external) state.scaler = next_state(state.scaler, config.scaler, true);
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    r.clip_coef = std::numeric_limits<float>::quiet_NaN();
    return finish(Outcome::skipped_overflow,
                  r.nonfinite_count > 0 ? SkipReason::nonfinite_gradient : SkipReason::external_found_inf);
  }
  if (!(std::isfinite(scale) && scale > 0.0f)) {  // an external scale nothing can be unscaled by
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    r.clip_coef = std::numeric_limits<float>::quiet_NaN();
    return finish(Outcome::skipped_nonfinite_update, SkipReason::invalid_loss_scale);
  }

  r.grad_norm = std::sqrt(sum_sq) / S;
  const double clip = config.max_grad_norm > 0.0f
                          ? std::min(1.0, config.max_grad_norm / (r.grad_norm + 1e-6))
                          : 1.0;
  r.clip_coef = static_cast<float>(clip);
  // Finite gradients whose update could not be finite: nothing written, nothing advanced.
  const SkipReason range = update_range(config, max_abs * (clip / S), count_up(state.step));
  if (range != SkipReason::none) return finish(Outcome::skipped_nonfinite_update, range);

  const SpikeVerdict verdict = observe_norm(state.spike, config.spike, r.grad_norm);
  state.spike = verdict.next;
  r.spike = verdict.spike;
  if (verdict.spike && config.spike.action == SpikeConfig::Action::skip) {
    return finish(Outcome::skipped_spike, SkipReason::spike);  // the scale and the step counter stay
  }

  // Pass 2: AdamW with the applied-step counter after this step.
  state.step = count_up(state.step);
  for (std::size_t t = 0; t < tensors.size(); ++t) {  // no gradient: left alone
    if (tensors[t].grad != nullptr) r.held_elements += apply_tensor(tensors[t], t, config, clip / S, state.step);
  }
  if (!external) state.scaler = next_state(state.scaler, config.scaler, false, r.headroom_log2);
  return finish(Outcome::applied, SkipReason::none);
}

StepReport reference_step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                          OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor) {
  const StepTotals totals = reference_measure(tensors, config, 0, nonfinite_per_tensor);
  return reference_finish(tensors, config, state, totals);
}

}  // namespace detail

namespace reference {

StepReport step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor) {
  validate(tensors, config);
  validate_state(state, config);
  // As FusedAdamW: a step at the limit would leave a counter unable to count it (the relations
  // between counters would break), so it is refused before anything changes.
  if (state.attempts >= kCounterLimit) {
    throw Error(ErrorKind::usage, detail::concat("reference::step: this state has attempted ", kCounterLimit,
                                                 " steps (kCounterLimit); its counters are full"));
  }
  return detail::reference_step(tensors, config, state, nonfinite_per_tensor);
}

}  // namespace reference
}  // namespace halfstep

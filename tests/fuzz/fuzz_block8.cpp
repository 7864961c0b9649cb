// Fuzz target: the block-wise 8-bit moment codec (kernels/block8.hpp). Any block of fp32 bit
// patterns (NaN, infinities, subnormals, -0 included), any size, either map and rounding: a block
// is refused exactly when one of its values is not finite, and otherwise every code decodes to a
// finite value of the right sign that is one of the two map values around the value's magnitude
// (to nearest: the nearer), a positive value under never_zero never decodes to 0, and the scale
// is the block's absmax. One block's AdamW step from any stored state (codes, scales, masters,
// gradients) either holds the whole block, changing nothing, or writes only finite values.
#include <algorithm>

#include "block8.hpp"
#include "fuzz_input.hpp"
#include "state_codec.hpp"

using namespace halfstep::detail;
using halfstep_fuzz::Input;
using halfstep_fuzz::violated;

namespace {

bool finite(float x) { return std::isfinite(x); }

// The magnitudes of map values on either side of |y| (y already divided by the absmax).
void around(const Codec8& c, float y, float& lo, float& hi) {
  lo = 0.0f;
  hi = INFINITY;
  for (int p = 0; p <= c.top; ++p) {
    if (c.magnitude[p] <= y) lo = c.magnitude[p];
    if (c.magnitude[p] >= y && c.magnitude[p] < hi) hi = c.magnitude[p];
  }
}

void check_encode(Input& in) {
  const bool is_signed = in.flag(), stochastic = in.flag(), never_zero = !is_signed && in.flag();
  const Codec8& codec = is_signed ? kSignedCodec8 : kUnsignedCodec8;
  const int n = 1 + in.take<std::uint8_t>();  // 1 .. 256
  float x[kBlock8];
  std::uint32_t random[kBlock8];
  bool all_finite = true;
  float absmax = 0.0f;
  for (int i = 0; i < n; ++i) {
    x[i] = in.take<float>();
    if (!is_signed && finite(x[i])) x[i] = std::fabs(x[i]);  // the unsigned map holds square roots
    random[i] = in.take<std::uint32_t>();
    all_finite = all_finite && finite(x[i]);
    if (finite(x[i])) absmax = std::max(absmax, std::fabs(x[i]));
  }
  std::uint8_t codes[kBlock8];
  for (std::uint8_t& c : codes) c = 0xA5;
  float scale = -7.0f;
  const bool ok = encode_block8(codec, x, n, stochastic, random, 0, never_zero, codes, scale);
  if (ok != all_finite) violated("encode_block8 refuses exactly the blocks with inf or NaN");
  if (!ok) {
    if (scale != -7.0f) violated("a refused block's scale is untouched");
    for (int i = 0; i < n; ++i) {
      if (codes[i] != 0xA5) violated("a refused block's codes are untouched");
    }
    return;
  }
  if (scale != scale8(absmax)) violated("the scale is the block's absmax (0 below fp32's smallest normal)");
  const float inverse = inverse8(scale);
  if (!finite(inverse)) violated("the scale's reciprocal is finite");
  for (int i = 0; i < n; ++i) {
    const float value = decode8(codec, codes[i], scale);
    if (!finite(value)) violated("every code decodes to a finite value");
    if ((value < 0.0f && x[i] > 0.0f) || (value > 0.0f && x[i] < 0.0f)) violated("a code keeps its value's sign");
    if (never_zero && x[i] > 0.0f && codes[i] == kUnsignedZero8) violated("a positive square root never decodes to 0");
    const float y = std::fabs(x[i] * inverse);
    const float magnitude = std::fabs(codec.map.value[codes[i]]);
    float lo, hi;
    around(codec, y, lo, hi);
    if (!std::isfinite(hi)) hi = lo;  // past 1: the top
    const bool floor_or_ceiling = magnitude == lo || magnitude == hi;
    const bool forced = (never_zero && x[i] > 0.0f && codes[i] == 1) ||                 // lifted off 0
                        (is_signed && x[i] * inverse < -codec.magnitude[127] && codes[i] == 0);  // no -1
    if (!floor_or_ceiling && !forced) violated("a code is one of the two map values around its magnitude");
    if (!stochastic && !forced && std::fabs(magnitude - y) > std::fabs((magnitude == lo ? hi : lo) - y)) {
      violated("to nearest, the nearer of the two");
    }
  }
}

template <class Master>
void check_step(Input& in, bool draw, bool with_model = true) {
  const int n = 1 + in.take<std::uint8_t>();
  typename Master::Stored ps[kBlock8];
  std::uint16_t model[kBlock8];
  std::uint8_t mc[kBlock8], vc[kBlock8];
  float g[kBlock8];
  std::uint32_t random[kBlock8];
  for (int i = 0; i < n; ++i) {
    ps[i] = in.take<typename Master::Stored>();
    model[i] = in.take<std::uint16_t>();
    mc[i] = in.take<std::uint8_t>();
    vc[i] = in.take<std::uint8_t>();
    g[i] = in.take<float>();
    random[i] = in.take<std::uint32_t>();
  }
  float ms = in.take<float>(), vs = in.take<float>();
  halfstep::detail::GroupParams params{0.9f, 0.999f, 1e-8f, 0.01f, 1, 1, {0, 0}, 0};
  const GroupConsts k = group_consts(params, std::fabs(in.take<float>()), 1 + in.take<std::uint8_t>());
  // Stored state as a step leaves it: finite, non-negative scales.
  if (!finite(ms) || !finite(vs) || !finite(k.step_size)) return;
  ms = std::fabs(ms);
  vs = std::fabs(vs);
  for (int i = 0; i < n; ++i) {
    if (!finite(g[i])) g[i] = 0.0f;  // a step with inf or NaN gradients never reaches pass 2
  }
  typename Master::Stored ps0[kBlock8];
  std::uint16_t model0[kBlock8];
  std::uint8_t mc0[kBlock8], vc0[kBlock8];
  std::memcpy(ps0, ps, sizeof ps);
  std::memcpy(model0, model, sizeof model);
  std::memcpy(mc0, mc, sizeof mc);
  std::memcpy(vc0, vc, sizeof vc);
  const float ms0 = ms, vs0 = vs;
  const bool held = draw ? update_block8<Master, true>(kSignedCodec8, kUnsignedCodec8, ps, model, mc, vc, ms, vs, g, n,
                                                       with_model, random, k)
                         : update_block8<Master, false>(kSignedCodec8, kUnsignedCodec8, ps, model, mc, vc, ms, vs, g, n,
                                                        with_model, random, k);
  if (held) {
    if (std::memcmp(ps0, ps, sizeof ps) != 0 || std::memcmp(model0, model, sizeof model) != 0 ||
        std::memcmp(mc0, mc, sizeof mc) != 0 || std::memcmp(vc0, vc, sizeof vc) != 0 || ms != ms0 || vs != vs0) {
      violated("a held block changes nothing");
    }
    return;
  }
  if (!finite(ms) || !finite(vs) || ms < 0.0f || vs < 0.0f) violated("a step writes finite, non-negative scales");
  for (int i = 0; i < n; ++i) {
    if (!finite(Master::decode(ps[i], model[i]))) violated("a step writes finite masters");
    if (with_model && !bf16_finite(model[i])) violated("a step writes finite model copies");
    if (!with_model && model[i] != model0[i]) violated("without a model copy none is written");
    if (!finite(decode8(kSignedCodec8, mc[i], ms)) || !finite(decode8(kUnsignedCodec8, vc[i], vs))) {
      violated("a step writes moments that decode to finite values");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  using halfstep::DType;
  using halfstep::MasterFormat;
  switch (in.take<std::uint8_t>() % 4) {
    case 0: check_encode(in); break;
    case 1: {
      const bool draw = in.flag(), with_model = in.flag();  // in this order
      check_step<MasterCodec<MasterFormat::f32, DType::bf16>>(in, draw, with_model);
      break;
    }
    case 2: check_step<MasterCodec<MasterFormat::bf16_remainder, DType::bf16>>(in, in.flag()); break;
    default: check_step<MasterCodec<MasterFormat::none, DType::bf16>>(in, in.flag()); break;
  }
  return 0;
}

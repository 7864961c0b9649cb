// Internal: what pass 2 computes for one element of a tensor with one stored value per element
// (fp32 or bf16 moments), host-and-device: the apply kernel (kernels/apply.cu) and the host
// backend (src/host_passes.cpp) run this very code, so they write the same bits.
#pragma once

#include <cstdint>

#include "halfstep/config.hpp"
#include "state_codec.hpp"
#include "step_math.hpp"

namespace halfstep::detail {

// The formats of one instantiation of pass 2: the master's (with the model copy's) and each
// moment's codec (state_codec.hpp).
template <DType kModel, MasterFormat kMaster, MomentFormat kM, MomentFormat kV>
struct Formats {
  using Master = MasterCodec<kMaster, kModel>;
  using M = MomentCodec<kM>;
  using V = MomentCodec<kV>;
  // Stochastic rounding draws its bits only where a moment is narrower than fp32 or the weight is
  // rounded (no master).
  static constexpr bool kNarrow = kM != MomentFormat::f32 || kV != MomentFormat::f32 || Master::kRounds;
};

// The random bits of element `index` for stochastic rounding: the moments' (bf16 moments round
// with its halves) and the weight's (no master: weight_bits of the same draw).
template <class F, bool kDraw>
HALFSTEP_HD inline void draw(std::uint64_t key, std::int64_t index, std::uint32_t& moments, std::uint32_t& w) {
  moments = kDraw ? element_bits(key, index) : 0u;
  w = kDraw && F::Master::kRounds ? weight_bits(moments) : 0u;
}

// One element: decoded, updated by AdamW in fp32 and encoded (bf16 moments rounded stochastically
// with `random`'s halves when kDraw, else to nearest; without a master the weight with
// `random_w`) into the *_new values, computed whatever the input (no branch). Returns whether every
// encoded value is finite, that is whether the element may be written.
template <class F, bool kDraw>
HALFSTEP_HD inline bool encode_element(typename F::Master::Stored ps, std::uint16_t model, typename F::M::Stored ms,
                                       typename F::V::Stored vs, float g, bool with_model, std::uint32_t random,
                                       std::uint32_t random_w, const GroupConsts& k, typename F::Master::Stored& ps_new,
                                       std::uint16_t& model_new, typename F::M::Stored& ms_new,
                                       typename F::V::Stored& vs_new) {
  float p = F::Master::decode(ps, model), m = F::M::decode(ms), v = F::V::decode(vs);
  adamw_update(p, m, v, g, k);
  ps_new = typename F::Master::Stored{};
  ms_new = typename F::M::Stored{};
  vs_new = typename F::V::Stored{};
  model_new = 0;
  return F::Master::encode(p, with_model, kDraw, random_w, ps_new, model_new) &
         F::M::encode(m, kDraw, random, ms_new) & F::V::encode(v, kDraw, random >> 16, vs_new);
}

// One element updated in place: encode_element's values, or the old ones where they would not all
// be finite (every value is written back, the old or the new: selects, no branch). Returns whether
// it was kept.
template <class F, bool kDraw>
HALFSTEP_HD inline bool update_element(typename F::Master::Stored& ps, std::uint16_t& model, typename F::M::Stored& ms,
                                       typename F::V::Stored& vs, float g, bool with_model, std::uint32_t random,
                                       std::uint32_t random_w, const GroupConsts& k) {
  typename F::Master::Stored ps_new;
  typename F::M::Stored ms_new;
  typename F::V::Stored vs_new;
  std::uint16_t model_new;
  const bool ok = encode_element<F, kDraw>(ps, model, ms, vs, g, with_model, random, random_w, k, ps_new, model_new,
                                           ms_new, vs_new);
  ps = ok ? ps_new : ps;
  ms = ok ? ms_new : ms;
  vs = ok ? vs_new : vs;
  model = ok ? model_new : model;
  return !ok;
}

}  // namespace halfstep::detail

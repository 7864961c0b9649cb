// Fuzz target: the checkpoint decoder. Whatever the bytes, decode_state either throws a
// corrupt_state Error or returns a checkpoint that re-encodes to the same bytes (an older
// version: to a current one that is stable under decode and encode), loads into its
// own configuration, and resumes: reference steps from it never throw (but the step past
// kCounterLimit attempts, refused as usage with nothing changed) and never write a value that is
// not finite. Each input is tried as it is and with its checksum recomputed, so the
// fuzzer also reaches the field checks behind the CRC.
#include <zlib.h>

#include <string>
#include <string_view>

#include "fuzz_input.hpp"
#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"
#include "halfstep/reference.hpp"

using namespace halfstep;
using halfstep_fuzz::violated;

namespace {

// The format version a checkpoint's header names (after the four-byte magic, little-endian).
std::uint32_t format_version(std::string_view bytes) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[4 + static_cast<std::size_t>(i)])) << (8 * i);
  return v;
}

void check(std::string_view bytes) {
  SavedState saved;
  try {
    saved = decode_state(bytes);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::corrupt_state) violated("decode_state threw an Error that is not corrupt_state");
    return;
  }
  const std::string again = encode_state(saved.state, saved.config);
  if (format_version(bytes) == kStateFormatVersion) {
    if (again != bytes) violated("an accepted checkpoint does not re-encode to itself");
  } else {  // an older version is read, then written in the current one: that must be stable
    const SavedState upgraded = decode_state(again);
    if (!(upgraded.state == saved.state) || encode_state(upgraded.state, upgraded.config) != again) {
      violated("an accepted older checkpoint does not re-encode to a stable current one");
    }
  }
  try {
    (void)load_state(bytes, saved.config);
  } catch (const Error&) {
    violated("an accepted checkpoint does not load into its own configuration");
  }
  try {  // another configuration: a named refusal or a fit, nothing else
    (void)load_state(bytes, StepConfig{});
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::corrupt_state) violated("load_state threw an Error that is not corrupt_state");
  }

  // Resume: one small tensor per group (the first eight), three steps.
  halfstep_fuzz::Model model(saved.config.grad_dtype);
  const std::size_t groups = saved.config.groups.size();
  for (std::size_t g = 0; g < groups && g < 8; ++g) model.add(4 + g, static_cast<std::int32_t>(g), g % 2 == 0);
  OptimizerState state = saved.state;
  const std::uint16_t patterns[] = {0x3C00, 0x0001, 0x7BFF, 0xBC00, 0x0000, 0x7F7F};
  for (int k = 0; k < 3; ++k) {
    for (std::size_t t = 0; t < model.grad.size(); ++t) {
      for (std::size_t i = 0; i < model.master[t].size(); ++i) {
        // fp32 gradients take the pattern as their upper half (the bf16 value, widened).
        const std::uint32_t p = patterns[(i + t + static_cast<std::size_t>(k)) % 6];
        model.set_grad(t, i, model.grad_bytes == 4 ? p << 16 : p);
      }
    }
    const halfstep_fuzz::Model before = model;
    StepReport r{};
    if (state.attempts >= kCounterLimit) {  // counters full: refused, nothing changed
      const OptimizerState full = state;
      try {
        (void)reference::step(model.views(), saved.config, state);
        violated("a step at kCounterLimit attempts ran");
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::usage || !(state == full)) violated("a step at kCounterLimit was not refused cleanly");
      }
      break;
    }
    try {
      r = reference::step(model.views(), saved.config, state);
    } catch (const Error&) {
      violated("a step from an accepted checkpoint threw");
    }
    halfstep_fuzz::check_step(r, before, model, saved.config.model_dtype);
    if (r.attempt != state.attempts || state.attempts > kCounterLimit) violated("the attempt counter is wrong");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  check(bytes);
  if (size >= 16) {  // the same bytes with a valid checksum
    const uLong crc = crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                            static_cast<uInt>(size - 4));
    for (int i = 0; i < 4; ++i) bytes[size - 4 + static_cast<std::size_t>(i)] = static_cast<char>((crc >> (8 * i)) & 0xFFu);
    check(bytes);
  }
  return 0;
}

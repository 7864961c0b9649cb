// Fuzz target: the checkpoint decoder. Whatever the bytes, decode_state either throws a
// corrupt_state Error or returns a checkpoint that re-encodes to the same bytes, loads into its
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

void check(std::string_view bytes) {
  SavedState saved;
  try {
    saved = decode_state(bytes);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::corrupt_state) violated("decode_state threw an Error that is not corrupt_state");
    return;
  }
  if (encode_state(saved.state, saved.config) != bytes) violated("an accepted checkpoint does not re-encode to itself");
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
  halfstep_fuzz::Model model;
  const std::size_t groups = saved.config.groups.size();
  for (std::size_t g = 0; g < groups && g < 8; ++g) model.add(4 + g, static_cast<std::int32_t>(g), g % 2 == 0);
  OptimizerState state = saved.state;
  const std::uint16_t patterns[] = {0x3C00, 0x0001, 0x7BFF, 0xBC00, 0x0000, 0x7F7F};
  for (int k = 0; k < 3; ++k) {
    for (std::size_t t = 0; t < model.grad.size(); ++t) {
      for (std::size_t i = 0; i < model.grad[t].size(); ++i) model.grad[t][i] = patterns[(i + t + static_cast<std::size_t>(k)) % 6];
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

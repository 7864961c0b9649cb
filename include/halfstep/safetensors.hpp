// halfstep: a complete, resumable checkpoint of everything a FusedAdamW owns or updates — fp32
// masters, Adam moments, the fp16/bf16 model copies and the optimizer state — in the safetensors
// format, which Python's safetensors package, PyTorch, JAX and most of this ecosystem read. The
// tensor names are the caller's.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "halfstep/fused_adamw.hpp"

namespace halfstep {

/// What save_checkpoint writes besides the masters, moments and optimizer state.
struct CheckpointOptions {
  /// Also write the model copies (name + ".model"). They can be recomputed from the masters, and
  /// load_checkpoint does so when a file has none.
  bool include_model = true;
  /// The caller's own string pairs (epoch, data position, ...), stored in the file's metadata.
  /// Keys starting with "halfstep." are halfstep's.
  std::map<std::string, std::string> metadata;
};

/// Writes `opt`'s tensors and state to `path` as safetensors: for tensor i (in the order the
/// optimizer was built with), its fp32 master as `names[i]`, its moments as `names[i] + ".exp_avg"`
/// and `names[i] + ".exp_avg_sq"` (F32), its model copy as `names[i] + ".model"` (F16 or BF16),
/// each one-dimensional; the metadata holds "halfstep.version" and "halfstep.optimizer_state"
/// (save_state, hex-encoded) next to the caller's pairs. Waits for the last step, works on either
/// backend, and replaces `path` only once the whole file is written.
void save_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names, const std::string& path,
                     const CheckpointOptions& options = {});

/// Restores what save_checkpoint wrote into `opt`'s buffers and state, bit for bit. Every tensor
/// is matched by name (any shape with the right number of elements and the right dtype is
/// accepted) and the optimizer state against `opt`'s configuration before anything is written; a
/// truncated file, a missing or mismatched tensor or a state from another configuration throws
/// halfstep::Error (ErrorKind::corrupt_state) naming it, and `opt` is unchanged. Model copies
/// missing from the file are recomputed from the masters. Returns the caller's metadata.
std::map<std::string, std::string> load_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names,
                                                   const std::string& path);

/// The same for one rank of a sharded run (ZeRO-style, see halfstep::shard): opt's tensor i is
/// elements [shard.offset[i], shard.offset[i] + numel) of the file's tensor names[shard.source[i]]
/// (`names` names the layout's tensors). A checkpoint of whole tensors therefore resumes on any
/// number of ranks, each reading only its slices: save one from an unsharded optimizer, or from
/// one built on buffers gathered from the shards (every rank holds the same optimizer state, so
/// any rank's save_state serves). Everything is checked before anything is written; model copies
/// missing from the file are recomputed from the masters.
std::map<std::string, std::string> load_checkpoint(FusedAdamW& opt, const Shard& shard,
                                                   const std::vector<std::string>& names, const std::string& path);

/// The caller's metadata of a checkpoint file, without loading anything (to check it first).
/// Throws halfstep::Error (corrupt_state) if the file is not a safetensors file.
std::map<std::string, std::string> checkpoint_metadata(const std::string& path);

}  // namespace halfstep

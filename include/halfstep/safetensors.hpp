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
/// (save_state, hex-encoded) next to the caller's pairs. Under MomentFormat::block8 a quantized
/// tensor's moments are its codes (U8, shaped [rows, row] of the tensor, so that the blocks can be
/// read from the file) with `names[i] + ".exp_avg.scale"` and `".exp_avg_sq.scale"` (F32, [rows,
/// blocks a row]); such a tensor must be whole (offset 0, whole_numel its numel): save from whole
/// tensors, and load into each rank's shard. The F32 tensors come first in the data, then the
/// 2-byte ones, then the codes, so that every tensor starts at a multiple of its element size. Waits for
/// the last step, works on either backend, and replaces `path` only once the whole file is
/// written (to `path + ".partial"`, flushed to the disk, then renamed).
///
/// Throws halfstep::Error, leaving `path` as it was: invalid_argument, before any work, if `path`
/// exists and is not a regular file (a device, a FIFO, a directory), if its directory does not
/// exist or is not writable, or if `path + ".partial"` exists and is not a regular file;
/// invalid_argument if a write, the flush or the close fails (a full disk, say); usage if a value
/// is one load_checkpoint refuses (a checkpoint that could not be loaded is never written).
HALFSTEP_API void save_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names, const std::string& path,
                     const CheckpointOptions& options = {});

/// Restores what save_checkpoint wrote into `opt`'s buffers and state, bit for bit. Moments in
/// another format are converted: F32 or BF16 values (and block8 codes, decoded with their
/// scales in the stored tensor's blocks: exp_avg_sq squared) into fp32 exactly, into bf16 to
/// nearest even, into block8 codes block by block as a step encodes them, to nearest. Every tensor
/// is matched by name (any shape with the right number of elements and the right dtype is
/// accepted, but for block8 codes, whose last dimension is their tensor's row) and the optimizer state against `opt`'s configuration before anything is written; a
/// truncated file, a missing or mismatched tensor or a state from another configuration throws
/// halfstep::Error (ErrorKind::corrupt_state) naming it, and `opt` is unchanged. Model copies
/// missing from the file are recomputed from the masters. Returns the caller's metadata.
///
/// A checkpoint is input, and everything is read and checked before the first byte of `opt` is
/// written. The whole header, every entry of it: at most 100,000,000 bytes of JSON, nested at
/// most 8 deep, at most 2^20 tensors and 2^16 metadata pairs, no name, key or field twice, known
/// safetensors dtypes, each tensor's bytes the size of its shape and starting at a multiple of its
/// element size, and, as Python's safetensors package requires, the tensors' byte ranges sorted by
/// their start covering the data section exactly, without overlap or gap. The values loaded:
/// masters and moments finite, second moments >= 0, model copies finite, and each master of a
/// tensor with a model copy rounding to a finite one (at most 65504 in magnitude for fp16, give or
/// take the rounding). A refusal names the tensor, the element or field, and the rule. A path
/// that is not a regular file is refused (invalid_argument) without being opened.
HALFSTEP_API std::map<std::string, std::string> load_checkpoint(FusedAdamW& opt, const std::vector<std::string>& names,
                                                   const std::string& path);

/// The same for one rank of a sharded run (ZeRO-style, see halfstep::shard): opt's tensor i is
/// elements [shard.offset[i], shard.offset[i] + numel) of the file's tensor names[shard.source[i]]
/// (`names` names the layout's tensors). A checkpoint of whole tensors therefore resumes on any
/// number of ranks, each reading only its slices: save one from an unsharded optimizer, or from
/// one built on buffers gathered from the shards (every rank holds the same optimizer state, so
/// any rank's save_state serves). Everything is checked before anything is written; model copies
/// missing from the file are recomputed from the masters.
HALFSTEP_API std::map<std::string, std::string> load_checkpoint(FusedAdamW& opt, const Shard& shard,
                                                   const std::vector<std::string>& names, const std::string& path);

/// The caller's metadata of a checkpoint file, without loading anything (to check it first).
/// Throws halfstep::Error (corrupt_state) if the file is not a safetensors file whose header
/// passes the checks load_checkpoint makes of it.
HALFSTEP_API std::map<std::string, std::string> checkpoint_metadata(const std::string& path);

}  // namespace halfstep

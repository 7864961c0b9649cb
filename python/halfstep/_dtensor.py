"""DTensor parameters (FSDP2's fully_shard, tensor parallelism): what FusedAdamW needs to know of
them. Each rank steps the local tensors it holds; the step's totals record is all-reduced over
every rank of the parameters' device mesh, and an element that several ranks hold (a Replicate()
dimension of the mesh) counts in the global norm on one of them only."""

import torch
import torch.distributed as _dist

try:  # PyTorch >= 2.4 has it public; 2.0-2.3 under _tensor; 1.13 has no DTensor
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # noqa: BLE001 (ImportError, or a package that fails to import on this Python)
    try:
        from torch.distributed._tensor import DTensor as _DTensor
    except Exception:  # noqa: BLE001
        _DTensor = None


def is_dtensor(t):
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t):
    """The tensor this rank holds of `t` (t itself unless it is a DTensor)."""
    return t._local_tensor if is_dtensor(t) else t


def version(t):
    """A value that changes whenever `t`'s values are written in place: a DTensor's own counter
    (in-place ops on the DTensor) and its local tensor's (writes into the shard itself)."""
    return (t._version, t._local_tensor._version) if is_dtensor(t) else t._version


def counts_in_norm(p):
    """Whether this rank's local tensor of DTensor `p` counts in the global norm: along every mesh
    dimension on which `p` is replicated, only the rank at coordinate 0 counts it (the others hold
    the same values: their inf/NaN are still seen)."""
    coordinate = p.device_mesh.get_coordinate()
    return all(coordinate[d] == 0 for d, placement in enumerate(p.placements) if placement.is_replicate())


def describe(p):
    """What every rank must agree on about DTensor `p`: global shape, mesh shape, placements."""
    return (tuple(p.shape), tuple(p.device_mesh.mesh.shape), tuple(str(x) for x in p.placements))


def check(params):
    """Raises ValueError unless the DTensors among `params` (parameter index, tensor) can be stepped
    together: all of them, on one mesh, with no Partial placement (an unreduced value)."""
    dtensors = [(i, p) for i, p in params if is_dtensor(p)]
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        plain = next(i for i, p in params if not is_dtensor(p))
        raise ValueError("parameter %d is a plain tensor and parameter %d a DTensor: one FusedAdamW steps either "
                         "plain tensors or the DTensors of one device mesh (FSDP2 shards every parameter it "
                         "wraps: call fully_shard on the root module too)" % (plain, dtensors[0][0]))
    mesh = dtensors[0][1].device_mesh
    for i, p in dtensors:
        if p.device_mesh != mesh:
            raise ValueError("parameter %d is on device mesh %s, parameter %d on %s: one FusedAdamW per mesh "
                             "(build one for each)" % (i, p.device_mesh, dtensors[0][0], mesh))
        for placement in p.placements:
            if placement.is_partial():
                raise ValueError("parameter %d has a Partial placement: its values are not reduced; FusedAdamW "
                                 "takes Shard and Replicate placements" % i)
    return mesh


def mesh_group(mesh, process_group):
    """The process group whose ranks all-reduce the step's record: every rank of `mesh`.
    `process_group` (if given) must be exactly those ranks; without it, a 1-D mesh's own group,
    or the default group when the mesh spans every process."""
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if process_group is not None:
        given = sorted(_dist.get_process_group_ranks(process_group))
        if given != ranks:
            raise ValueError("process_group: its ranks %s are not the parameters' device mesh's %s: the record is "
                             "all-reduced over every rank that holds a piece of the parameters (leave "
                             "process_group out to use the mesh's)" % (given, ranks))
        return process_group
    if mesh.ndim == 1:
        return mesh.get_group()
    if ranks == list(range(_dist.get_world_size())):
        return _dist.group.WORLD
    raise ValueError("the parameters' %d-D device mesh spans ranks %s of %d processes: pass process_group=, a "
                     "group of exactly those ranks (torch.distributed.new_group)" % (mesh.ndim, ranks,
                                                                                   _dist.get_world_size()))


def like(tensor, p, shape=None):
    """`tensor` (this rank's local piece, of p's local shape) as a DTensor laid out as `p`; with
    `shape`, a whole tensor of that shape cut as p's rows of dimension 0 are (a local piece of
    p's local rows)."""
    if shape is None:
        return _DTensor.from_local(tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
    stride = tuple(int(_numel(shape[d + 1:])) for d in range(len(shape)))
    return _DTensor.from_local(tensor, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                               stride=stride)


def piece(full, p):
    """This rank's piece of `full`, a whole tensor of DTensor p's global shape, laid out as p (each
    rank takes its own piece; nothing is communicated)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)._local_tensor


def global_offset(p):
    """The index in the whole tensor of the first element of this rank's local tensor of DTensor
    `p`, where the local tensor is one contiguous run of the whole tensor's elements (whole rows of
    dimension 0, as FSDP2's Shard(0) cuts, or everything); None where it is not (a Shard of another
    dimension cuts rows)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as locate
    except ImportError:  # PyTorch 2.0-2.3
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset as locate
    shape, offset = locate(p.shape, p.device_mesh, p.placements)
    if len(p.shape) == 0 or _numel(shape) == 0:
        return 0
    if tuple(shape[1:]) != tuple(p.shape[1:]) or any(offset[1:]):
        return None
    return int(offset[0]) * _numel(p.shape[1:])


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n

"""Where a FusedAdamW keeps this rank's optimizer state, one class per storage strategy:

- PerParameter: each parameter's state in tensors of its shape (one process, or every rank of a
  process group keeping all of it: shard=False). fp32 parameters are their own masters.
- DTensorShards: the same over the local shards of DTensor parameters (FSDP2); saved as DTensors.
- ZeroShard: this rank's chunk of the flat parameter space, one flat tensor per slot (ZeRO-1,
  shard=True); the new model copy is all-gathered into the parameters after each step.

Each holds slot -> tensor for the state slots (SLOTS: the master and the two moments), each in the
dtype of its format (_formats: an fp32 master, an int16 remainder beside the bfloat16 parameter, or
without a master the bfloat16 parameter itself; fp32 or bf16 moments), and builds the library's
tensor table over them; nothing else in the package knows where a slot's values live or how they
are stored. What users and checkpoints see of a slot (`shown`) is its values as they are: the
moments in their dtype, the master in fp32 (rebuilt from the parameter and its remainder, or the
parameter's own values without a master: a copy). A layout is built once per set of parameters; a rebuild
that keeps the parameters reuses its tensors (PerParameter, DTensorShards), so views handed out
survive it.
"""

import torch
import torch.distributed as _dist

from . import _dtensor, _formats, _sharding

SLOTS = ("master", "exp_avg", "exp_avg_sq")
MOMENTS = _formats.MOMENTS
SCALES = ("exp_avg_scale", "exp_avg_sq_scale")  # block8 moments' scales, beside their codes
KEYS = SLOTS + SCALES  # every key of a parameter's state the optimizer keeps


def _finite(t, i, key):
    if not bool(torch.isfinite(t).all()):
        raise ValueError("load_state_dict: state[%d]['%s'] holds inf or NaN: an applied step never writes one, so "
                         "this state was not written by a step" % (i, key))


def _take(slots, model, weights, master_format):
    """Weights written into the parameters become the masters of the elements that differ from
    their master rounded to the parameter's format (so writing the same values keeps the masters'
    precision); `model` (a ZeRO model chunk) takes the weights themselves. With remainders the
    written parameter is the master's upper half: an element keeps its remainder where the pair
    still rounds to the parameter (a write of the same value), else the master is the written value.
    Without a master the written weights are all there is."""
    if master_format == "none":
        if model is not None:
            model.copy_(weights)
        return
    if master_format == "bf16_remainder":
        if model is not None:
            model.copy_(weights)
        slots["master"].copy_(_formats.kept_remainders(weights, slots["master"]))
        return
    master = slots["master"]
    changed = weights != master.to(weights.dtype)
    master.copy_(torch.where(changed, weights.float(), master))
    if model is not None:
        model.copy_(weights)


class Layout:
    """What every layout knows: the parameters, what this rank holds of each (`local`), their groups,
    the flat parameter space and this rank's table rows (parameter index, offset in the parameter,
    length, offset in this rank's storage, counted in the norm)."""

    sharded = False  # the state is cut into ranks' chunks of the flat space (ZeRO)
    kind = None      # the name a state_dict records

    def __init__(self, params, group_of, world, rank, pg, formats):
        self.params = list(params)
        self.local = [_dtensor.local(p) for p in self.params]
        self.group_of = list(group_of)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.fp32 = self.dtype == torch.float32
        self.world, self.rank, self.pg = world, rank, pg
        self.state_formats = formats
        self.remainders = formats.remainders
        self.masterless = formats.masterless  # the parameter (or a ZeRO model chunk) is the weight
        self.formats = {name: formats.dtype(name) for name in SLOTS}  # slot -> the dtype it is stored in
        self.numels = [t.numel() for t in self.local]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        # Under block8, each parameter's blocks (_formats.Blocks) as this rank holds it, or None:
        # its shape has none and its moments are fp32 (every parameter, in the other formats).
        self.blocks = [self.shape_blocks(i) if formats.block8 else None for i in range(len(self.params))]
        # Where a cut inside parameter i may move to (block8's next block start), or None.
        self.starts = [None if b is None else b.next_start for b in self.blocks]
        self.table = self.rank_table(rank)
        self.pieces = [[] for _ in self.params]  # this rank's (offset, length, at) of each parameter
        for i, off, length, at, _ in self.table:
            self.pieces[i].append((off, length, at))

    def rank_table(self, rank):
        raise NotImplementedError

    def element_offset(self, i):
        """The index in the whole parameter of this rank's first element of parameter i."""
        return 0

    def shape_blocks(self, i):
        """The blocks parameter i's shape has (whatever this optimizer's formats), as this rank
        holds it, or None: a block8 optimizer keeps its moments in fp32."""
        p = self.params[i]
        return _formats.blocks(p.shape, p.numel(), self.numels[i], self.element_offset(i))

    def moment_dtype(self, i, name):
        """The dtype parameter i's moment `name` is stored in (block8 codes, or fp32 where its
        shape has no blocks)."""
        if self.state_formats.block8:
            return torch.uint8 if self.starts[i] is not None else torch.float32
        return self.formats[name]

    def new_moments(self, i, shape):
        """Parameter i's moments at zero, as a step stores them: {slot: tensor} (codes of 0 and
        scales of 0 under block8)."""
        out = {}
        for name in MOMENTS:
            dtype = self.moment_dtype(i, name)
            out[name] = torch.full(shape, _formats.ZERO_CODE[name] if dtype == torch.uint8 else 0, dtype=dtype,
                                   device=self.device)
            if dtype == torch.uint8:
                out[_formats.SCALE_OF[name]] = torch.zeros(self.blocks[i].scale_shape, dtype=torch.float32,
                                                           device=self.device)
        return out

    def zero_moments(self, i):
        """Parameter i's moments set to zero (opt.state emptied)."""
        for name, t in self.views(i).items():
            if name in MOMENTS:
                t.fill_(_formats.ZERO_CODE[name] if t.dtype == torch.uint8 else 0)
            elif name in SCALES:
                t.zero_()

    def param_of(self, rank, entry):
        """The parameter of entry `entry` of rank `rank`'s table."""
        table = self.table if rank == self.rank else self.rank_table(rank)
        return table[entry][0]

    def _row(self, slots, model, at, length, i, in_norm, offset):
        """One library table entry over `slots` (tensors whose element `at` starts the entry), for
        the elements of parameter i from `offset` on (stochastic rounding's index: the element's
        in the whole parameter, the same on every rank)."""
        row = {name: slots[name].data_ptr() + slots[name].element_size() * at for name in SLOTS}
        if self.masterless:
            row["master"] = 0  # the library holds no master: the model copy is the weight
        row.update(grad=0, model=0 if model is None else model.data_ptr() + model.element_size() * at,
                   numel=length, group=self.group_of[i], duplicate=not in_norm, tensor_id=i + 1, offset=offset)
        if self.state_formats.block8:  # the whole tensor's shape: where its blocks lie
            p = self.params[i]
            row.update(whole_numel=p.numel(), row=_formats.row_of(p.shape))
            b = self.blocks[i]
            if b is not None:  # the piece's scales: from its first block on
                first = b.first_of(offset, length) - b.first
                for name in MOMENTS:
                    scales = slots[_formats.SCALE_OF[name]]
                    row[_formats.SCALE_OF[name]] = scales.data_ptr() + 4 * first
        return row

    def grad_addresses(self, grads):
        """The address of each table entry's gradient (0: its parameter has none this step)."""
        elem = self.local[0].element_size()
        return [0 if grads[i] is None or grads[i].numel() == 0 else grads[i].data_ptr() + elem * off
                for i, off, _, _, _ in self.table]

    def model_of(self, i):
        """The bfloat16 model values beside parameter i's remainders, as views() cuts them."""
        raise NotImplementedError

    def rebuilt_slots(self):
        """The slots shown otherwise than stored (rebuilt on each read: a copy)."""
        return ("master",) if self.remainders or self.masterless else ()

    def shown(self, i, name):
        """Slot `name` of parameter i as users and checkpoints see it: the stored tensor itself, but
        for a master kept as a remainder: the fp32 masters, rebuilt (a copy); without a master: the
        weights' fp32 values (a copy)."""
        view = self.views(i).get(name)
        if view is None or name != "master" or not (self.remainders or self.masterless):
            return view
        if self.masterless:
            return view.float()
        return _formats.join(self.model_of(i), view)

    def saved(self):
        """{parameter index: a copy of its slots as this rank holds them} for a state_dict (a ZeRO
        rank's piece, with its offset, or nothing where the rank holds none of the parameter)."""
        out = {}
        for i in range(len(self.params)):
            views = self.views(i)
            out[i] = {k: self.shown(i, k).detach().clone() if k in KEYS else v for k, v in views.items()}
        return out

    def expected(self, i):
        """The shape a saved slot of parameter i must have here, or None where this rank holds none of it."""
        view = self.views(i).get("master")
        return None if view is None else tuple(view.shape)

    def to_local(self, i, name, t, shape=None):
        """A saved slot as this rank's tensor (the identity, but for DTensors; `shape`: a scale
        slot's, [rows, blocks per row] as this rank holds it)."""
        return t

    def saved_master(self, i, t):
        """A saved master (fp32, of the shape expected(i)) as this rank's tensor, or ValueError."""
        t = self.to_local(i, "master", t)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != self.expected(i):
            raise ValueError("load_state_dict: state[%d]['master'] must be a float32 tensor of shape %s"
                             % (i, self.expected(i)))
        _finite(t, i, "master")
        return t

    def saved_moment(self, i, name, entry, saved_block8=None):
        """{slot: tensor} to store for moment `name` of parameter i from its saved entry, checked
        (ValueError naming the rule): fp32 or bf16 values, or block8 codes with their scales
        (entry[name + '_scale']), each converted to this layout's format: codes and scales into the
        same blocks as they are (exact); values into block8 encoded to nearest; codes into fp32 or
        bf16 decoded (exp_avg_sq squared), then rounded as values are (fp32 into bf16 once, to
        nearest even; bf16 into fp32 exactly). `saved_block8`: whether the state_dict says it was
        saved with block8 moments (None: it does not say); a tensor whose shape has blocks must then
        hold codes, and otherwise values: torch.distributed.checkpoint loads into the dtypes of the
        state_dict it fills, and would have cast codes to values or values to codes."""
        shape = self.expected(i)
        where = "load_state_dict: state[%d]['%s']" % (i, name)
        t = self.to_local(i, name, entry.get(name))
        if not isinstance(t, torch.Tensor) or t.dtype not in _formats.MOMENT_DTYPES or tuple(t.shape) != shape:
            raise ValueError("%s must be a float32, bfloat16 or uint8 (block8 codes) tensor of shape %s" % (where, shape))
        has_blocks = self.shape_blocks(i) is not None
        if saved_block8 is not None and (t.dtype == torch.uint8) != (saved_block8 and has_blocks) and has_blocks:
            raise ValueError("%s is %s, but the state_dict was saved with %s moments: its values were cast on the way "
                             "(torch.distributed.checkpoint loads into the dtypes of the state_dict it fills). Load "
                             "the checkpoint into an optimizer of the format it was saved in (its state_dict() as "
                             "the one to fill), then load that optimizer's state_dict() into this one: it converts"
                             % (where, str(t.dtype)[6:], "block8" if saved_block8 else "fp32 or bf16"))
        mine = self.blocks[i]
        if t.dtype == torch.uint8:
            saved = mine if mine is not None else self.shape_blocks(i)
            if saved is None:
                raise ValueError("%s holds block8 codes, but parameter %d's shape %s has no blocks (fewer than 4096 "
                                 "elements, or rows of dimension 0 shorter than 32): a block8 optimizer keeps its "
                                 "moments in fp32" % (where, i, tuple(self.params[i].shape)))
            key = _formats.SCALE_OF[name]
            scales = self.to_local(i, key, entry.get(key), saved.scale_shape)
            if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
                    tuple(scales.shape) != saved.scale_shape:
                raise ValueError("load_state_dict: state[%d]['%s'] must be a float32 tensor of shape %s beside the "
                                 "block8 codes of '%s' (a scale per block)" % (i, key, saved.scale_shape, name))
            _finite(scales, i, key)
            if bool((scales < 0).any()):
                raise ValueError("load_state_dict: state[%d]['%s'] holds negative scales" % (i, key))
            if mine is not None:
                return {name: t, key: scales}
            t = _formats.decode(t.to(self.device), scales.to(self.device), name, saved)
        else:
            _finite(t, i, name)
            if name == "exp_avg_sq" and bool((t < 0).any()):
                raise ValueError("load_state_dict: state[%d]['exp_avg_sq'] holds negative values" % i)
            if mine is not None:
                codes, scales = _formats.encode(t.to(self.device), name, mine)
                return {name: codes.view(shape), _formats.SCALE_OF[name]: scales}
        stored = _formats.moment(t.to(self.device), getattr(self.state_formats, name)).view(shape)
        if not bool(torch.isfinite(stored).all()):
            raise ValueError("load_state_dict: state[%d]['%s'] holds values past %s's range: this optimizer keeps %s "
                             "in %s" % (i, name, str(stored.dtype)[6:], name, str(stored.dtype)[6:]))
        return {name: stored}

    def load(self, entries):
        """Writes checked {index: {slot: tensor}} (fp32 masters, moments in this layout's dtypes)
        into the state and the parameters (an index without an entry keeps its own)."""
        for i, entry in entries.items():
            if entry is None:
                continue
            views = self.views(i)
            if "master" not in views:
                continue
            for name, t in entry.items():
                if name != "master":
                    views[name].copy_(t.view(views[name].shape))
            self.write_master(i, entry["master"].view(views["master"].shape))
        self.loaded()

    def write_master(self, i, master):
        """fp32 masters into parameter i's state; the parameter (or a ZeRO model chunk) becomes the
        masters rounded to its dtype, as a step writes it. With a bf16 model the master is stored as
        a step stores it (canonical: _formats.canonical)."""
        raise NotImplementedError

    def loaded(self):
        """What follows writing loaded masters (ZeRO gathers the model chunks)."""

    def after_step(self):
        """What follows a step (or a skipped one): nothing, unless the layout gathers the weights."""

    def refused(self):
        """This rank refused its step while the others took it: what keeps the ranks' weights right."""


class PerParameter(Layout):
    """Each parameter's state in tensors of its (local) shape."""

    kind = "per_parameter"

    def __init__(self, params, group_of, world, rank, pg, formats, carried=None):
        super().__init__(params, group_of, world, rank, pg, formats)
        carried = carried or {}
        self.state = []
        for p, w in zip(self.params, self.local):
            given = carried.get(p, {})
            slots = {}
            if self.masterless:
                slots["master"] = w.detach()  # the parameter is the weight
            elif "master" in given:
                slots["master"] = given["master"]
            elif not self.remainders:
                slots["master"] = w.detach() if self.fp32 else w.detach().float().contiguous().clone()
            else:  # remainders (0: the master is the parameter's value)
                slots["master"] = torch.zeros(w.shape, dtype=self.formats["master"], device=self.device)
            fresh = self.new_moments(len(self.state), w.shape)
            slots.update({name: given.get(name, t) for name, t in fresh.items()})
            if self.fp32:  # the parameter is its own master (carrying the carried values)
                if slots["master"].data_ptr() != w.data_ptr():
                    w.detach().copy_(slots["master"].view_as(w))
                slots["master"] = w.detach()
            self.state.append(slots)

    def rank_table(self, rank):
        return _sharding.rank_table(self.numels, self.world, rank, self.pg is not None, False, self.starts)

    def entries(self):
        return [self._row(self.state[i], None if self.fp32 else self.local[i].detach(), off, length, i, in_norm,
                          self.element_offset(i) + off)
                for i, off, length, _, in_norm in self.table]

    def views(self, i):
        """Parameter i's slots: the very tensors the step writes."""
        return dict(self.state[i])

    def model_of(self, i):
        return self.local[i].detach()

    def carried(self, masters=True):
        """Every parameter's slots, for a layout rebuilt over these parameters and more: the same
        tensors (without the masters: for parameters whose storage moved, whose values the first
        step takes)."""
        return {p: {k: v for k, v in s.items() if masters or k != "master"} for p, s in zip(self.params, self.state)}

    def follows_storage(self):
        """Whether the table holds the parameters' own storage (a move needs a new table)."""
        return True

    def take(self, i):
        if not self.fp32 and not self.masterless:  # (without a master the parameter is the weight)
            _take({"master": self.state[i]["master"].view(-1)}, None, self.local[i].detach().reshape(-1),
                  self.state_formats.master)

    def set_slot(self, i, name, value):
        """A slot of parameter i written (opt.state[p][name] = value, in the slot's shown dtype); a
        master also into the parameter, rounded to its dtype, as a step writes it."""
        if name == "master":
            self.write_master(i, value.view(self.state[i]["master"].shape))
        else:
            self.state[i][name].copy_(value.view(self.state[i][name].shape))

    def write_master(self, i, master):
        param = self.local[i].detach()
        if self.masterless:  # the weight: an fp32 master rounds once, to nearest even
            param.copy_(master.view_as(param))
            return
        if self.remainders:
            model, remainder = _formats.split(master)
            param.copy_(model.view_as(param))
            self.state[i]["master"].copy_(remainder)
            return
        if self.dtype == torch.bfloat16:
            master = _formats.canonical(master)
        self.state[i]["master"].copy_(master)
        if not self.fp32:
            param.copy_(self.state[i]["master"].view_as(param))


class DTensorShards(PerParameter):
    """The local shards of DTensor parameters (FSDP2): every rank's table has one entry per
    parameter; an element on a Replicate() dimension counts in the norm on one rank only."""

    kind = "dtensor"

    def rank_table(self, rank):
        if rank != self.rank:
            return self.table
        return [(i, 0, n, 0, _dtensor.counts_in_norm(p)) for i, (p, n) in enumerate(zip(self.params, self.numels))]

    def element_offset(self, i):
        offset = _dtensor.global_offset(self.params[i])
        if offset is None:
            p = self.params[i]
            if self.state_formats.block8 and _formats.blocks(p.shape, p.numel(), p.numel(), 0) is not None:
                raise ValueError("parameter %d is a DTensor with placements %s: its local tensor is not whole rows of "
                                 "dimension 0, and block8 moments keep their blocks within those rows; shard it on "
                                 "dimension 0 (FSDP2's Shard(0)), or keep fp32 or bf16 moments"
                                 % (i, self.params[i].placements))
            if self.state_formats.random_bits:
                raise ValueError("parameter %d is a DTensor with placements %s: its local tensor is not one run of the "
                                 "whole tensor's elements, and stochastic rounding keys each element's bits by its "
                                 "index in the whole tensor; shard it on dimension 0 (FSDP2's Shard(0)), or use "
                                 "rounding='nearest'" % (i, self.params[i].placements))
            return 0  # (nothing reads it)
        return offset

    def saved(self):
        # DTensors laid out as the parameter: torch.distributed.checkpoint saves them sharded and
        # loads them into any other number of ranks (block8 scales: rows of dimension 0 as the
        # parameter's, a scale per block of a row).
        out = {}
        for i in range(len(self.params)):
            out[i] = {}
            for name in self.views(i):
                t = self.shown(i, name).detach().clone()
                out[i][name] = _dtensor.like(t, self.params[i], self.scale_shape(i) if name in SCALES else None)
        return out

    def scale_shape(self, i):
        """The whole tensor's block8 scales' shape: [rows of dimension 0, blocks per row]."""
        p = self.params[i]
        return (int(p.shape[0]), self.blocks[i].scale_shape[1])

    def to_local(self, i, name, t, shape=None):
        """A DTensor laid out as parameter i (what state_dict() gives, also after
        torch.distributed.checkpoint loaded it on another number of ranks), or a whole tensor of the
        parameter's global shape (a gathered state_dict), of which this rank takes its piece; a
        block8 scale slot (`shape`: this rank's) laid out in the parameter's rows."""
        p = self.params[i]
        whole = tuple(p.shape) if shape is None else (int(p.shape[0]), shape[1])
        local_shape = tuple(self.local[i].shape) if shape is None else tuple(shape)
        if _dtensor.is_dtensor(t):
            if t.device_mesh != p.device_mesh or t.placements != p.placements or tuple(t.shape) != whole:
                raise ValueError("load_state_dict: state[%d]['%s'] is a DTensor of shape %s with placements %s on %s; "
                                 "parameter %d's are %s, %s on %s: load it with torch.distributed.checkpoint into "
                                 "this optimizer's state_dict()" % (i, name, tuple(t.shape), t.placements,
                                                                    t.device_mesh, i, whole, p.placements,
                                                                    p.device_mesh))
            return _dtensor.local(t)
        if isinstance(t, torch.Tensor) and tuple(t.shape) == whole and tuple(t.shape) != local_shape:
            return _dtensor.piece(t, p)
        return t


class ZeroShard(Layout):
    """This rank's range of the flat parameter space: one flat tensor per slot, the model copy's
    range (fp32: the masters themselves) and a buffer the ranks' ranges are all-gathered into.
    Ranges are ceil(total / world) elements; under block8 a cut inside a parameter with blocks
    moves to its next block start (_sharding.bounds), each buffer holds the longest range, and the
    moments are a byte buffer per moment holding each piece at a multiple of 16 bytes (codes, or
    fp32 where the parameter keeps wide moments), with the pieces' scales one after another."""

    sharded = True
    kind = "zero"

    def __init__(self, params, group_of, world, rank, pg, formats, carried=None):
        super().__init__(params, group_of, world, rank, pg, formats)
        carried = carried or {}
        bounds = _sharding.bounds(self.numels, world, self.starts)
        self.chunk = max(max(b - a for a, b in zip(bounds, bounds[1:])), 1)  # the longest range
        n = self.chunk
        self.flat = {name: torch.zeros(n, dtype=self.formats[name], device=self.device)
                     for name in SLOTS if name != "master" or not self.masterless}
        if formats.block8:
            self.places, sizes = self.placements(self.table)
            for i in range(len(self.params)):
                self.blocks[i] = self.places[i][2] if i in self.places else None
            for name in MOMENTS:
                self.flat[name] = torch.zeros(max(sizes[0], 1), dtype=torch.uint8, device=self.device)
                self.flat[_formats.SCALE_OF[name]] = torch.zeros(max(sizes[1], 1), dtype=torch.float32,
                                                                 device=self.device)
        self.model = self.flat["master"] if self.fp32 else torch.zeros(n, dtype=self.dtype, device=self.device)
        if self.masterless:
            self.flat["master"] = self.model  # the model chunk is the weight
        self.gathered = torch.zeros(n * world, dtype=self.dtype, device=self.device)
        # What after_step copies out of the gathered ranges (rank r's at r * n): each rank's pieces.
        self.gather_copies = [(i, off, length, r * n + at) for r in range(world)
                              for i, off, length, at, _ in self.rank_table(r)]
        weights = [t.detach() for t in self.local]
        for i, off, length, at, _ in self.table:
            slots = carried.get(self.params[i])
            mine = self.views(i)
            if slots is not None:
                mine["master"].copy_(slots["master"].reshape(-1)[off:off + length])
                for name in MOMENTS:
                    mine[name].copy_(slots[name].reshape(-1)[off:off + length])
                    key = _formats.SCALE_OF[name]
                    if key in mine:
                        b = self.blocks[i]
                        mine[key].copy_(slots[key].reshape(-1)[b.first:b.first + b.count])
            else:
                if not self.remainders:
                    mine["master"].copy_(weights[i].reshape(-1)[off:off + length])
                for name in MOMENTS:
                    if mine[name].dtype == torch.uint8:
                        mine[name].fill_(_formats.ZERO_CODE[name])
            if not self.fp32:
                self.model[at:at + length].copy_(weights[i].reshape(-1)[off:off + length])

    def placements(self, table):
        """Under block8, where each piece of a rank's table lies in the moment buffers: {parameter
        index: (byte offset, first scale, the piece's Blocks or None)}, and the buffers' sizes
        (bytes, scales)."""
        places, byte, scale = {}, 0, 0
        for i, off, length, _, _ in table:
            p = self.params[i]
            b = _formats.blocks(p.shape, p.numel(), length, off) if self.starts[i] is not None else None
            if b is not None:
                b = b._replace(scale_shape=(b.count,))  # a piece of a flat range: its scales in a row
            places[i] = (byte, scale, b)
            byte += -(-(length * (1 if b is not None else 4)) // 16) * 16
            scale += b.count if b is not None else 0
        return places, (byte, scale)

    def rank_table(self, rank):
        return _sharding.rank_table(self.numels, self.world, rank, True, True, self.starts)

    def entries(self):
        return [self._row(self.views(i), None if self.fp32 else self.model[at:at + length], 0, length, i, in_norm, off)
                for i, off, length, at, in_norm in self.table]

    def views(self, i):
        """This rank's piece of the flattened parameter (at most one: a rank's range is contiguous)
        and where it starts in p.view(-1)."""
        out = {}
        for off, length, at in self.pieces[i]:
            out = {"master": self.flat["master"][at:at + length]}
            out.update(self.moment_views(i, length, at, self.flat, self.places if self.state_formats.block8 else None))
            out["offset"] = off
        return out

    def moment_views(self, i, length, at, flat, places):
        """Parameter i's moments (and scales) in buffers `flat` laid out by `places` (block8), or
        at element `at` of typed buffers."""
        if places is None:
            return {name: flat[name][at:at + length] for name in MOMENTS}
        byte, scale, b = places[i]
        out = {}
        for name in MOMENTS:
            if b is None:
                out[name] = flat[name][byte:byte + 4 * length].view(torch.float32)
            else:
                out[name] = flat[name][byte:byte + length]
                key = _formats.SCALE_OF[name]
                out[key] = flat[key][scale:scale + b.count]
        return out

    def model_of(self, i):
        for _, length, at in self.pieces[i]:
            return self.model[at:at + length]
        return None

    def follows_storage(self):
        """The table holds this rank's flat buffers only: the parameters are read and written
        where they are at each step."""
        return False

    def carried(self):
        """Every parameter's slots in full (the ranks all-gather their buffers, each padded to the
        longest: a collective). The remainders belong to the parameters' values, which every rank
        holds after each step."""
        tables = [self.rank_table(r) for r in range(self.world)]
        layouts = [self.placements(t) if self.state_formats.block8 else (None, None) for t in tables]
        parts = {}
        for name, mine in self.flat.items():
            size = mine.numel()
            if self.state_formats.block8 and name != "master":
                size = max(max(1, (sizes[0] if name in MOMENTS else sizes[1])) for _, sizes in layouts)
            padded = torch.zeros(size, dtype=mine.dtype, device=self.device)
            padded[:mine.numel()].copy_(mine)
            got = [torch.empty_like(padded) for _ in range(self.world)]
            if padded.dtype in (torch.bfloat16, torch.int16):
                _dist.all_gather([x.view(torch.uint8) for x in got], padded.view(torch.uint8), group=self.pg)  # (gloo
                # reduces no bfloat16)
            else:
                _dist.all_gather(got, padded, group=self.pg)
            parts[name] = got
        wholes = []
        for i, p in enumerate(self.params):
            whole = {"master": torch.empty(p.numel(), dtype=self.flat["master"].dtype, device=self.device)}
            for name in MOMENTS:
                whole[name] = torch.empty(p.numel(), dtype=self.moment_dtype(i, name), device=self.device)
                if self.starts[i] is not None:
                    whole[_formats.SCALE_OF[name]] = torch.zeros(self.shape_blocks(i).count, dtype=torch.float32,
                                                                 device=self.device)
            wholes.append(whole)
        for r, table in enumerate(tables):
            for i, off, length, at, _ in table:
                whole = wholes[i]
                whole["master"][off:off + length].copy_(parts["master"][r][at:at + length])
                got = self.moment_views(i, length, at, {k: v[r] for k, v in parts.items()}, layouts[r][0])
                for name in MOMENTS:
                    whole[name][off:off + length].copy_(got[name])
                    key = _formats.SCALE_OF[name]
                    if key in got:
                        b = layouts[r][0][i][2]
                        whole[key][b.first:b.first + b.count].copy_(got[key])
        return {p: {k: v.view(p.shape) if k in SLOTS else v.view(self.shape_blocks(i).scale_shape)
                    for k, v in whole.items()} for i, (p, whole) in enumerate(zip(self.params, wholes))}


    def take(self, i):
        flat = self.local[i].detach().reshape(-1)
        for off, length, at in self.pieces[i]:
            _take({"master": self.flat["master"][at:at + length]}, None if self.fp32 else self.model[at:at + length],
                  flat[off:off + length], self.state_formats.master)

    def set_slot(self, i, name, value):
        for off, length, at in self.pieces[i]:
            if name != "master":
                self.views(i)[name].copy_(value.reshape(-1))
                continue
            self.write_master(i, value.reshape(-1))
            # the parameter's piece, as the step's gather writes it
            self.params[i].detach().view(-1)[off:off + length].copy_(self.model[at:at + length])

    def write_master(self, i, master):
        for _, length, at in self.pieces[i]:
            if self.masterless:  # the weight: an fp32 master rounds once, to nearest even
                self.model[at:at + length].copy_(master)
                continue
            if self.remainders:
                model, remainder = _formats.split(master)
                self.model[at:at + length].copy_(model)
                self.flat["master"][at:at + length].copy_(remainder)
                continue
            if self.dtype == torch.bfloat16:
                master = _formats.canonical(master)
            self.flat["master"][at:at + length].copy_(master)
            if not self.fp32:
                self.model[at:at + length].copy_(self.flat["master"][at:at + length])

    def refused(self):
        # The ranks all-gather every chunk of the model copy after the step: a refusing rank's chunk
        # must be the weights its parameters hold (written weights it did not get to take).
        for i in range(len(self.params)):
            if self.local[i].numel() == self.numels[i]:
                self.take(i)

    def loaded(self):
        self.after_step()

    def after_step(self):
        """Every rank's range of the model copy into every parameter."""
        parts = list(self.gathered.view(torch.uint8).chunk(self.world))
        _dist.all_gather(parts, self.model.view(torch.uint8), group=self.pg)
        for i, off, length, src in self.gather_copies:
            self.params[i].detach().view(-1)[off:off + length].copy_(self.gathered[src:src + length])

    def pieces_of_chunk(self, chunk):
        """{parameter index: {slot: its piece}} of a whole chunk of this rank ({slot: fp32 tensor}:
        the form of halfstep 0.3's state_dicts)."""
        return {i: {name: chunk[name][at:at + length] for name in SLOTS}
                for i in range(len(self.params)) for _, length, at in self.pieces[i]}


def build(params, group_of, world, rank, pg, mesh, shard, formats, carried=None):
    """The layout for these parameters: DTensorShards on a device mesh, ZeroShard with a sharded
    process group, PerParameter otherwise; each slot in its format (`formats`, _formats.Formats)."""
    if mesh is not None:
        return DTensorShards(params, group_of, world, rank, pg, formats, carried)
    if shard:
        return ZeroShard(params, group_of, world, rank, pg, formats, carried)
    return PerParameter(params, group_of, world, rank, pg, formats, carried)

"""FusedAdamW's state_dict and load_state_dict.

The state_dict is torch.optim's shape, so that torch.save, torch.distributed.checkpoint and its
get_optimizer_state_dict / set_optimizer_state_dict (accelerate's FSDP2 save_state, torchtitan,
Lightning) carry all of it: "state" maps each parameter's index to its slots (the fp32 master,
also where the optimizer keeps it as a remainder, or keeps none (the weights' values), and the
moments in their dtype, laid out as the layout saves them) and its "step"; "param_groups" holds the groups'
hyperparameters, and group 0 the optimizer's own state under "halfstep" (a param group's keys are
what those tools keep besides the state). Entries of opt.state that are not a parameter's, and
keys a user added to a parameter's entry, are kept as torch.optim keeps them.

load_state_dict takes what state_dict gave, also after those tools renamed the parameters to
their fully qualified names (entries are matched by position, as torch.optim matches them), and
state_dicts of halfstep 0.3 (the entry at the top level). A state_dict of other state formats
loads converted: fp32 moments into bf16 ones round once, to nearest even; bf16 into fp32 are
exact; block8 codes (uint8, with their fp32 scales under 'exp_avg_scale' and 'exp_avg_sq_scale')
load into the same blocks as they are, into fp32 or bf16 decoded, and fp32 or bf16 moments into
block8 encoded to nearest (_layouts.Layout.saved_moment); the fp32 masters become remainders exactly (a step with a bfloat16 model stores a master in
its canonical form, _formats.canonical, in either master format), or without a master the weights,
rounded to nearest even. Everything is checked before
anything changes; with a process group every rank agrees before any rank changes.
"""

import hashlib as _hashlib

import torch

from . import _hyper, _lib, _ranks, version
from ._layouts import KEYS, MOMENTS, SLOTS

KEY = _hyper.STATE_KEY
_KNOWN = set(SLOTS) | {"step", "offset"}  # entry keys the optimizer writes itself (and the scales of codes)
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def shapes_digest(shapes):
    """A short digest of the parameters' shapes: the state_dict records it (not the list, which
    torch.distributed.checkpoint's flattened form would repeat for every parameter of group 0)."""
    return _hashlib.blake2b(repr([tuple(s) for s in shapes]).encode(), digest_size=8).hexdigest()


def save(opt):
    """opt's state_dict (see the module's docstring); the caller holds the lock."""
    layout = opt._layout
    groups = []
    index = 0
    for g in opt.param_groups:
        d = {k: v for k, v in g.items() if k not in ("params", KEY)}
        d["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        groups.append(d)
    state = layout.saved()
    step = opt._step_copy.detach().clone()
    for i, entry in state.items():
        entry["step"] = step
        entry.update(opt.state.extras(opt._params[i]))
    state.update(opt.state.foreign())
    library = opt._opt
    groups[0][KEY] = {
        "version": version(),
        # The library's state as a uint8 tensor: torch.load(weights_only=True) reads it.
        "optimizer_state": torch.frombuffer(bytearray(library.save_state()), dtype=torch.uint8),
        "world": opt._world, "rank": opt._rank, "layout": layout.kind, "shard": layout.sharded,
        "n_params": len(opt._params), "shapes_digest": shapes_digest(opt._shapes), "dtype": _NAMES[opt._dtype],
        "state_format": opt._formats.describe(),
        "pushed": [[h[0], list(h[1]), h[2], h[3]] for h in opt._pushed],
        # The loss scaler's rules, for an optimizer built without them that resumes this run.
        "scaler": {k: v for k, v in opt._scaler_options_now().items()},
    }
    return {"state": state, "param_groups": groups}


def entry_of(state_dict):
    """The halfstep entry: group 0's, or the top level's (halfstep 0.3)."""
    if not isinstance(state_dict, dict):
        return None
    groups = state_dict.get("param_groups")
    if isinstance(groups, (list, tuple)) and groups and isinstance(groups[0], dict) and isinstance(
            groups[0].get(KEY), dict):
        return groups[0][KEY]
    hs = state_dict.get(KEY)
    return hs if isinstance(hs, dict) else None


def _positional(state, groups, count):
    """The saved state's entries by parameter position: its groups' "params" name each entry's key
    (indices, or fully qualified names after torch.distributed.checkpoint's state_dict API), in the
    order the optimizer's parameters are."""
    keys = [k for g in groups for k in g["params"]]
    if len(keys) != count:
        raise ValueError("load_state_dict: the state_dict's param_groups list %d parameters, this optimizer has %d"
                         % (len(keys), count))
    if not isinstance(state, dict):
        raise ValueError("load_state_dict: 'state' must be a dict")
    return {i: state.get(k) for i, k in enumerate(keys)}, set(keys)


def _pushed(h):
    """A saved entry of what the optimizer last pushed, checked: (lr, betas, eps, weight_decay),
    lr None for a rate a tensor on the device gave."""
    checked = _hyper.check(0.0 if h[0] is None else h[0], h[1], h[2], h[3], "load_state_dict: ['halfstep']['pushed']")
    return checked if h[0] is not None else _hyper.Hyper(None, checked[1], checked[2], checked[3])


class Checked:
    """The parts of a state_dict, each checked against an optimizer."""

    def __init__(self, opt, state_dict):
        hs = entry_of(state_dict)
        if hs is None or "optimizer_state" not in hs:
            raise ValueError("load_state_dict: not a halfstep.torch.FusedAdamW state_dict (no 'halfstep' entry in "
                             "param_groups[0])")
        layout = opt._layout
        saved_shard = bool(hs.get("shard"))
        if saved_shard != layout.sharded:
            raise ValueError("load_state_dict: written by an optimizer with shard=%s; this one has shard=%s"
                             % (saved_shard, layout.sharded))
        # A sharded (ZeRO) state_dict holds one rank's chunk: the same rank of the same world loads
        # it. Every other layout's holds every parameter's state (DTensors: any world loads them).
        if layout.sharded and (hs.get("world") != opt._world or hs.get("rank") != opt._rank):
            raise ValueError("load_state_dict: a shard=True state_dict holds one rank's chunk of the state; this one was "
                             "written by rank %s of %s ranks, and this is rank %d of %d. Save each rank's state_dict "
                             "itself (torch.save) and load it on the same rank: torch.distributed.checkpoint keeps one "
                             "copy of tensors that are not DTensors, so it cannot hold ZeRO-1 chunks (use shard=False "
                             "or FSDP2 with it)" % (hs.get("rank"), hs.get("world"), opt._rank, opt._world))
        if "shapes" in hs:  # halfstep 0.3
            same = isinstance(hs["shapes"], (list, tuple)) and [tuple(x) for x in hs["shapes"]] == opt._shapes
        else:
            same = hs.get("n_params") == len(opt._shapes) and hs.get("shapes_digest") == shapes_digest(opt._shapes)
        if not same:
            raise ValueError("load_state_dict: written for %s parameters of other shapes; this optimizer's %d are %s"
                             % (hs.get("n_params", len(hs.get("shapes", ()) or ())), len(opt._shapes), opt._shapes))
        if hs.get("dtype", _NAMES[opt._dtype]) != _NAMES[opt._dtype]:
            raise ValueError("load_state_dict: written for %s parameters; this optimizer's are %s"
                             % (hs.get("dtype"), _NAMES[opt._dtype]))
        groups = state_dict.get("param_groups", [])
        if not isinstance(groups, (list, tuple)) or len(groups) != len(opt.param_groups):
            raise ValueError("load_state_dict: %s parameter groups, this optimizer has %d" %
                             (len(groups) if isinstance(groups, (list, tuple)) else "no list of",
                              len(opt.param_groups)))
        for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
            where = "load_state_dict: param_groups[%d]" % i
            if not isinstance(saved, dict) or not all(k in saved for k in ("params",) + _hyper.HYPERPARAMETERS):
                raise ValueError(where + " must be a dict with params, lr, betas, eps and weight_decay")
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("%s has %d parameters, this optimizer's %d" % (where, len(saved["params"]),
                                                                                 len(mine["params"])))
            _hyper.of_group(saved, where, device=layout.device)
        self.groups = groups
        pushed = hs.get("pushed")
        if pushed is None and isinstance(hs.get("pushed_lr"), (list, tuple)):  # halfstep 0.2's state_dict
            pushed = [[lr, g.get("betas"), g.get("eps"), g.get("weight_decay")]
                      for lr, g in zip(hs["pushed_lr"], groups)] if len(hs["pushed_lr"]) == len(groups) else None
        if not isinstance(pushed, (list, tuple)) or len(pushed) != len(opt.param_groups):
            raise ValueError("load_state_dict: ['halfstep']['pushed'] must hold one entry per group")
        try:
            self.pushed = [_pushed(h) for h in pushed]
        except (TypeError, IndexError, KeyError):
            raise ValueError("load_state_dict: ['halfstep']['pushed'] must hold (lr, betas, eps, weight_decay) "
                             "per group") from None
        blob = hs["optimizer_state"]
        blob = bytes(blob.tolist()) if isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 else blob
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError("load_state_dict: ['halfstep']['optimizer_state'] must be a uint8 tensor")
        self.blob = bytes(blob)
        scaler = hs.get("scaler")
        self.scaler = dict(scaler) if isinstance(scaler, dict) else None
        # The seed of stochastic rounding's bits (halfstep >= 0.5; the library's state carries it too).
        fmt = hs.get("state_format")
        seed = fmt.get("seed") if isinstance(fmt, dict) else None
        try:
            self.seed = _lib.seed(seed) if isinstance(seed, int) else None
        except ValueError:
            self.seed = None
        moments = fmt.get("exp_avg") if isinstance(fmt, dict) else None
        self._check_state(opt, state_dict.get("state", {}), old="shapes" in hs,
                          saved_block8=None if moments is None else moments == "block8")

    def _check_state(self, opt, state, old, saved_block8=None):
        layout = opt._layout
        count = len(opt._params)
        if layout.sharded and old:  # halfstep 0.3: the rank's whole chunk under key 0
            chunk = state.get(0) if isinstance(state, dict) else None
            if not isinstance(chunk, dict) or not all(isinstance(chunk.get(k), torch.Tensor) and
                                                      chunk[k].shape == layout.flat[k].shape for k in SLOTS):
                raise ValueError("load_state_dict: state[0] must hold this rank's chunk of %d elements per slot"
                                 % layout.flat["master"].numel())
            by_position, keys = layout.pieces_of_chunk(chunk), {0}
        else:
            by_position, keys = _positional(state, self.groups, count)
        self.entries, self.extras = {}, {}
        for i in range(count):
            entry = by_position.get(i)
            if entry is None and not opt._params[i].requires_grad:
                # torch.distributed.checkpoint's set_optimizer_state_dict leaves out frozen parameters'
                # state: such a parameter keeps its own.
                self.entries[i] = None
                continue
            if not isinstance(entry, dict):
                raise ValueError("load_state_dict: no state for tensor %d" % i)
            shape = layout.expected(i)
            if shape is None:  # this rank holds none of the parameter (ZeRO-1)
                self.entries[i] = None
                self.extras[i] = _extras(layout, i, entry)
                continue
            local = {"master": layout.saved_master(i, entry.get("master"))}
            for key in MOMENTS:
                local.update(layout.saved_moment(i, key, entry, saved_block8))
            if not bool(torch.isfinite(local["master"].to(opt._dtype)).all()):
                raise ValueError("load_state_dict: state[%d]['master'] holds values past %s's range: the parameters "
                                 "could not hold them" % (i, str(opt._dtype)[6:]))
            self.entries[i] = local
            self.extras[i] = _extras(layout, i, entry)
        # Entries of "state" that are no parameter's (torch.optim keeps them).
        self.foreign = {k: v for k, v in state.items() if k not in keys} if isinstance(state, dict) else {}


def _extras(layout, i, entry):
    """The keys of a saved entry the user added: all but the optimizer's own (a block8 moment's
    scales are the optimizer's where parameter i's shape has blocks)."""
    own = _KNOWN | (set(KEYS) - set(SLOTS) if layout.shape_blocks(i) is not None else set())
    return {k: v for k, v in entry.items() if k not in own}


def load(opt, state_dict):
    """Restores state_dict() into opt (the caller holds the lock): checked first, then agreed on by
    every rank of a process group, then taken."""
    error, checked, before = None, None, None
    try:
        opt._follow_replaced_params()
        checked = Checked(opt, state_dict)
        before = opt._library_snapshot()
        opt._adopt_scaler_rules(checked.scaler)  # a run resumed by an optimizer built without them
        opt._opt.load_state(checked.blob)        # checks the state against the config, then takes it
    except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
        if before is not None:
            opt._library_restore(before)
        if opt._pg is None:
            raise
        error = e
    if opt._pg is not None:
        # Every rank holds the same library state (scaler, counters, rates): the ranks compare it,
        # so that checkpoints of different steps are not mixed.
        all_ok, same = _ranks.agree(opt._pg, opt._collective_device(), error is None,
                                    checked.blob if error is None else b"")
        if error is None and not (all_ok and same):
            opt._library_restore(before)  # keep what this rank had
            error = ValueError("load_state_dict: " + (
                "another rank of the process group refused its state_dict" if not all_ok else
                "the ranks' state_dicts hold different optimizer states (scaler, counters or rates): they "
                "were not saved at the same step") + "; no rank loaded anything")
    if error is not None:
        raise error
    layout = opt._layout
    with torch.no_grad():
        # The parameters become the masters rounded to their dtype (round to nearest even, as the
        # step writes them), so the model resumes exactly without its own state_dict.
        layout.load(checked.entries)
    opt._after_load(checked)

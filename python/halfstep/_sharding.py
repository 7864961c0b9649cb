"""The flat parameter space of a FusedAdamW over a process group: the parameters laid end to end
(in param-group order) and cut into one range per rank of ceil(total / world) elements, anywhere,
also mid-parameter."""


def chunk_size(total, world):
    """Elements per rank: ceil(total / world)."""
    return -(-total // world)


def bounds(numels, world, starts=None):
    """Where each rank's range of the flat space begins (world + 1 entries, the last the total):
    every ceil(total / world) elements, a cut inside parameter i moved by starts[i] (a function of
    the index in the parameter, or None: the cut stays) to where a piece may start (block8: the
    next block start), so that a range may be up to 255 elements longer or shorter."""
    total = sum(numels)
    chunk = chunk_size(total, world)
    out = []
    for r in range(world + 1):
        x = min(total, r * chunk)
        at = 0
        for i, n in enumerate(numels):
            if at < x < at + n:
                if starts is not None and starts[i] is not None:
                    x = at + starts[i](x - at)
                break
            at += n
        out.append(x)
    return out


def rank_table(numels, world, rank, distributed, shard, starts=None):
    """What each entry of rank `rank`'s halfstep tensor table is: (parameter index, offset in the
    parameter, length, offset in the rank's chunk, counted in the norm). Without a process group
    (`distributed` false) every parameter is one entry. Sharded (ZeRO-1), a rank's entries are the
    pieces of its range. Replicated, every rank holds every parameter; each element counts in the
    norm on one rank only, the one whose range holds it (its inf/NaN are seen by all). `starts`:
    per parameter None, or a function moving a cut to where a piece may start (block8: the next
    block start): sharded, the ranges' bounds move (bounds()); replicated, each rank's cuts do, so
    that the ranks' ranges still tile the space."""
    total = sum(numels)
    chunk = chunk_size(total, world)
    begin = min(total, rank * chunk)
    end = min(total, begin + chunk)
    if shard:
        begin, end = bounds(numels, world, starts)[rank:rank + 2]
    out, at = [], 0
    for i, n in enumerate(numels):
        lo, hi = max(at, begin), min(at + n, end)
        if not distributed:
            pieces = [(0, n, True)]
        elif shard:
            pieces = [(lo - at, hi - lo, True)] if lo < hi else []
        else:
            move = (starts[i] if starts is not None else None) or (lambda x: x)
            cut = sorted({0, n, move(min(max(begin - at, 0), n)), move(min(max(end - at, 0), n))})
            pieces = [(a, b - a, begin <= at + a < end) for a, b in zip(cut, cut[1:]) if b > a]
        for off, length, in_norm in pieces:
            out.append((i, off, length, at + off - begin, in_norm))
        at += n
    return out

#!/usr/bin/env python3
"""Asserts the signature of a halfstep-train scenario on its --trace CSV, or that a trace loads with
the defaults of the usual CSV readers.

usage: check_scenario.py SCENARIO TRACE.csv
       check_scenario.py --defaults TRACE.csv

Each check states the dynamics the scenario exists to show (see halfstep-train --help). The trace
is read as plain CSV, a header line and rows; --defaults reads it with csv.DictReader, numpy's
genfromtxt and pandas' read_csv, each with its defaults."""
import csv
import math
import sys


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{path}: empty trace")
    for r in rows:
        for k in ("loss", "scale_used", "scale_next", "headroom_log2"):
            r[k] = float(r[k])
        for k in ("attempt", "step", "spike", "subnormal_count", "zero_count", "numel"):
            r[k] = int(r[k])
    return rows


def mean(xs):
    return sum(xs) / len(xs)


def log2(x):
    return math.log2(x)


def require(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    return ok


def share(rows, key):
    return mean([r[key] / r["numel"] for r in rows])


def loss_falls(rows, factor):
    first, last = mean([r["loss"] for r in rows[:100]]), mean([r["loss"] for r in rows[-100:]])
    return require(last < first / factor,
                   f"loss falls by more than {factor}x: {first:.4f} -> {last:.4f}")


def check(name, rows):
    outcomes = [r["outcome"] for r in rows]
    overflow = [o == "skipped_overflow" for o in outcomes]
    ok = True
    if name == "default":
        half = rows[len(rows) // 2:]
        scales = [log2(r["scale_next"]) for r in half]
        ok &= require(any(overflow), f"the scale reaches overflow ({sum(overflow)} overflow steps)")
        ok &= require(max(scales) - min(scales) <= 2,
                      f"second half: the scale stays within 2^2 ({min(scales):.0f}..{max(scales):.0f})")
        ok &= require(mean(overflow[len(rows) // 2:]) < 0.05,
                      f"second half: under 5% of steps skipped ({100 * mean(overflow[len(rows) // 2:]):.1f}%)")
        ok &= loss_falls(rows, 2.5)
    elif name == "overflow-storm":
        k = next(i for i, o in enumerate(overflow) if not o)
        low = min(range(len(rows)), key=lambda i: rows[i]["scale_next"])
        drop = log2(rows[0]["scale_used"]) - log2(rows[low]["scale_next"])
        ok &= require(k >= 3, f"a burst of {k} skipped steps at the start")
        ok &= require(drop >= 4, f"the scale falls by 2^{drop:.0f} (>= 2^4)")
        ok &= require(max(r["scale_next"] for r in rows[low:]) > rows[low]["scale_next"],
                      "then grows again")
        ok &= loss_falls(rows, 2.5)
    elif name == "lr-decay":
        first, last = share(rows[:100], "subnormal_count"), share(rows[-100:], "subnormal_count")
        ok &= require(not any(overflow), "no overflow event")
        ok &= require(last > 1.5 * first and last > 0.01,
                      f"subnormal share rises: {100 * first:.3f}% -> {100 * last:.3f}%")
        ok &= require(rows[-1]["scale_next"] == rows[0]["scale_used"], "the scale never grows")
        ok &= loss_falls(rows, 20)
    elif name == "lr-decay-headroom":
        grown = log2(rows[-1]["scale_next"]) - log2(rows[0]["scale_used"])
        last = share(rows[-100:], "subnormal_count")
        ok &= require(grown >= 8, f"the scale keeps up: grew by 2^{grown:.0f}")
        ok &= require(last < 0.0005, f"subnormal share stays low: {100 * last:.3f}%")
        ok &= require(mean(overflow) < 0.02, f"overflows stay rare ({sum(overflow)})")
        ok &= loss_falls(rows, 20)
    elif name == "spike":
        spiked = [r["attempt"] for r in rows if r["outcome"] == "skipped_spike"]
        flagged = [r["attempt"] for r in rows if r["spike"]]
        expected = len(rows) * 3 // 4 + 1  # the default --spike-step, 3/4 in, is this attempt
        ok &= require(spiked == [expected], f"exactly attempt {expected} skipped as a spike: {spiked}")
        ok &= require(flagged == [expected], f"and flagged: {flagged}")
        ok &= require(not any(overflow), "no overflow")
        ok &= loss_falls(rows, 2.5)
    elif name == "fixed-scale-low":
        zeros = share(rows, "zero_count")
        last = mean([r["loss"] for r in rows[-100:]])
        ok &= require(zeros > 0.5, f"most gradients underflow to zero ({100 * zeros:.1f}%)")
        ok &= require(last > 0.3, f"the loss stalls ({last:.3f}; the default scenario reaches ~0.1)")
        ok &= require(not any(overflow), "no overflow")
    elif name == "fixed-scale-high":
        ok &= require(all(overflow), f"every step overflows ({sum(overflow)}/{len(rows)})")
        ok &= require(rows[-1]["step"] == 0, "no step is applied")
    else:
        sys.exit(f"unknown scenario {name}")
    return ok


def loads_with_defaults(path):
    """The trace as csv, numpy and pandas read a CSV file when given nothing but its name."""
    with open(path, newline="") as f:
        header, *lines = f.read().splitlines()
    if not require(header.startswith("attempt,step,"), f"the first line is the header: {header[:60]!r}"):
        return False
    losses = [float(line.split(",")[5]) for line in lines]  # the loss, sixth of halfstep-train's columns
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    ok = require(len(rows) == len(lines) and all(len(r) == 19 and None not in r for r in rows),
                  f"csv.DictReader: {len(rows)} rows of 19 named fields")
    import numpy

    try:
        table = numpy.genfromtxt(path, delimiter=",", names=True)
        ok &= require(table.shape == (len(lines),) and list(table["loss"]) == losses,
                      f"numpy.genfromtxt(path, delimiter=',', names=True): {table.shape[0]} rows, the same losses")
    except (ValueError, KeyError) as e:
        ok &= require(False, f"numpy.genfromtxt(path, delimiter=',', names=True): {e!r}")
    try:
        import pandas
    except ImportError:
        return require(False, "pandas.read_csv(path): pandas is not installed (tools/install_deps.sh installs "
                              "Debian's python3-pandas)") and ok
    try:
        frame = pandas.read_csv(path)
        ok &= require(list(frame.columns) == header.split(",") and list(frame["loss"]) == losses,
                      f"pandas.read_csv(path): {len(frame)} rows, the same columns and losses")
    except (ValueError, KeyError) as e:  # pandas' ParserError is a ValueError
        ok &= require(False, f"pandas.read_csv(path): {e!r}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    if sys.argv[1] == "--defaults":
        sys.exit(0 if loads_with_defaults(sys.argv[2]) else 1)
    sys.exit(0 if check(sys.argv[1], load(sys.argv[2])) else 1)

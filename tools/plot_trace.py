#!/usr/bin/python3
"""Plots a halfstep-train --trace CSV on one step axis: the loss with the learning rate, the loss
scale (log2) with overflow and spike markers, the unscaled gradient norm, and the shares of
gradient elements that underflowed (subnormal, zero) on a log axis. The title names the runs that
wrote the trace, from the description halfstep-train writes next to it (TRACE.csv.json), if there
is one. Installed as halfstep-plot; runs with Debian's python3 and python3-matplotlib.

TRACE.csv must be a regular file of at most 1 GiB and 5 million rows, in halfstep-train's format:
comma-separated and unquoted, a header line of column names, then one row per step (lines that
start with '#', which older versions wrote above the header, are skipped). Whatever is wrong with
it is said in one line, 'halfstep-plot: TRACE.csv: what is wrong', with exit code 2. Exit code 1
means that the plot could not be written."""
import argparse
import itertools
import json
import math
import os
import re
import stat
import sys
import textwrap
from array import array

# The version: CMake writes it in place of the placeholder when it installs this script as
# halfstep-plot; run from the source tree, the script reads it where CMake does, from
# include/halfstep/config.hpp.
INSTALLED_VERSION = "@PROJECT_VERSION@"

# Bounds on what is read, so that a device (/dev/urandom), a FIFO or a huge file cannot exhaust
# the memory: a trace row is about 200 bytes, so 1 GiB holds about 5 million steps, far more than
# a plot shows apart. A description names a few runs in a few hundred bytes each.
MAX_BYTES = 1 << 30
MAX_ROWS = 5_000_000
MAX_LINE = 1 << 20
MAX_DESCRIPTION = 1 << 20

# The columns the plot reads (halfstep-train writes more), and what each must hold.
INT_COLUMNS = ("attempt", "numel", "subnormal_count", "zero_count")
FLOAT_COLUMNS = ("loss", "lr", "scale_used", "grad_norm")
COLUMNS = INT_COLUMNS + FLOAT_COLUMNS + ("outcome", "spike")


class BadInput(Exception):
    """What is wrong with an input, in one line."""


def lines(f):
    """The file's lines (without their line breaks) with their numbers, read within the bounds."""
    total = 0
    for number in itertools.count(1):
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            return
        total += len(raw)
        if total > MAX_BYTES:
            raise BadInput(f"grew past {MAX_BYTES} bytes (1 GiB) while it was read")
        if len(raw) > MAX_LINE:
            raise BadInput(f"line {number} is longer than {MAX_LINE} bytes: not a halfstep-train trace")
        try:
            yield number, raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise BadInput(f"line {number} is not text (UTF-8): not a halfstep-train trace") from None


def value(text, kind, column, number):
    try:
        parsed = kind(text)
        float(parsed)  # the plot holds doubles: an integer past them is refused as well
        return parsed
    except (ValueError, OverflowError):
        what = "an integer" if kind is int else "a number"
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise BadInput(f"line {number}: {column} is '{shown}', not {what}") from None


def version():
    """halfstep's version, or None when neither CMake wrote it here nor the source tree is around."""
    if not INSTALLED_VERSION.startswith("@"):
        return INSTALLED_VERSION
    config = os.path.join(os.path.dirname(os.path.realpath(__file__)), os.pardir, "include", "halfstep", "config.hpp")
    try:
        with open(config, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    parts = [re.search(rf"^#define HALFSTEP_VERSION_{part} ([0-9]+)$", text, re.MULTILINE)
             for part in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


class VersionAction(argparse.Action):
    """--version: 'halfstep-plot X.Y.Z', or exit code 1 when the version cannot be found."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        found = version()
        if found is None:
            fail("--version", "unknown: this copy of the script was not installed by CMake and has no "
                              "include/halfstep/config.hpp beside it", 1)
        print(f"halfstep-plot {found}")
        parser.exit()


def state_text(run):
    """The optimizer state's formats a run recorded (runs of halfstep before 0.5 recorded none)."""
    state = run.get("state")
    if not isinstance(state, dict):
        return ""
    master = "no master" if state.get("master") == "none" else f"{state.get('master')} masters"
    text = f", {master}, {state.get('exp_avg')}/{state.get('exp_avg_sq')} moments"
    if state.get("precision", "f16") != "f16":  # runs before --precision were f16
        text = f", {state.get('precision')}" + text
    if state.get("master") == "none" or {"bf16", "block8"} & {state.get("exp_avg"), state.get("exp_avg_sq")}:
        text += f" ({state.get('rounding')} rounding)"
    return text


def describe(path):
    """The title the trace's description gives (the runs that wrote it), or None without one. A
    description that cannot be read is said on the standard error; the plot goes on without it."""
    name = path + ".json"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        print(f"halfstep-plot: {name}: {e.strerror}; the title names the trace instead", file=sys.stderr)
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError("not a regular file")
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_DESCRIPTION + 1)
        if len(raw) > MAX_DESCRIPTION:
            raise ValueError(f"longer than {MAX_DESCRIPTION} bytes")
        runs = json.loads(raw.decode("utf-8"))["runs"]
        titles = [f"{run['command']} (halfstep {run['halfstep']}, {run['engine']}{state_text(run)})" for run in runs]
    except (OSError, ValueError, KeyError, TypeError) as e:  # a JSONDecodeError is a ValueError
        shown = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
        print(f"halfstep-plot: {name}: not a halfstep-train trace description ({shown}); the title names "
              f"the trace instead", file=sys.stderr)
        return None
    return "; then ".join(titles) if titles else None


def read(path):
    """The trace's columns, and the run it came from (the '# ' comment lines older versions wrote)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise BadInput(e.strerror) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise BadInput(f"not a regular file but {kind}")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_BYTES:
            raise BadInput(f"{st.st_size} bytes, more than the {MAX_BYTES} (1 GiB) a trace may have")
        if st.st_size == 0:
            raise BadInput("empty")
        comments, header = [], None
        cols = {c: array("d") for c in ("attempt", "loss", "lr", "scale", "norm", "sub", "zero")}
        over, spike = array("b"), array("b")
        for number, line in lines(f):
            if not line.strip():
                continue
            if line.startswith("#"):
                if line.startswith("# "):
                    comments.append(line[2:])
                continue
            fields = line.split(",")
            if header is None:
                missing = [c for c in COLUMNS if c not in fields]
                if missing:
                    raise BadInput(f"not a halfstep-train trace: its header (line {number}) lacks the "
                                   f"column{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
                header = {name: i for i, name in enumerate(fields)}
                width = len(fields)
                continue
            if len(fields) != width:
                raise BadInput(f"line {number} has {len(fields)} fields, the header {width}")
            if len(over) == MAX_ROWS:
                raise BadInput(f"more than {MAX_ROWS} rows, more than a plot can show")
            row = {c: value(fields[header[c]], int, c, number) for c in INT_COLUMNS}
            row.update({c: value(fields[header[c]], float, c, number) for c in FLOAT_COLUMNS})
            if not (math.isfinite(row["scale_used"]) and row["scale_used"] > 0):
                raise BadInput(f"line {number}: scale_used is {fields[header['scale_used']]}, not a loss scale")
            numel = max(row["numel"], 1)
            cols["attempt"].append(row["attempt"])
            cols["loss"].append(row["loss"])
            cols["lr"].append(row["lr"])
            cols["scale"].append(math.log2(row["scale_used"]))
            cols["norm"].append(row["grad_norm"])
            cols["sub"].append(100 * row["subnormal_count"] / numel)
            cols["zero"].append(100 * row["zero_count"] / numel)
            over.append(fields[header["outcome"]] == "skipped_overflow")
            spike.append(fields[header["spike"]] == "1")
        if header is None:
            raise BadInput("no header line: not a halfstep-train trace")
        if not over:
            raise BadInput("no rows after the header: the run recorded no step")
    return cols, over, spike, comments


def fail(name, what, code):
    print(f"halfstep-plot: {name}: {what}", file=sys.stderr)
    sys.exit(code)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", metavar="TRACE.csv", help="what halfstep-train --trace wrote")
    ap.add_argument("-o", "--output", required=True, metavar="IMAGE",
                    help="the plot to write; its extension names the format (png, pdf, svg, ...)")
    ap.add_argument("--title", default=None,
                    help="the plot's title (default: the runs that TRACE.csv.json names, else the trace's name)")
    ap.add_argument("--version", action=VersionAction, help="print halfstep-plot's version and exit")
    args = ap.parse_args()

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as e:
        fail("matplotlib", f"{e} (Debian: apt-get install python3-matplotlib)", 1)
    # The format follows the output's extension; an unknown one is refused before any work.
    extension = os.path.splitext(args.output)[1][1:].lower() or matplotlib.rcParams["savefig.format"]
    if extension not in FigureCanvasAgg.get_supported_filetypes():
        fail(args.output, f"unknown image format '{extension}' (give one of "
                          f"{', '.join(sorted(FigureCanvasAgg.get_supported_filetypes()))})", 2)
    try:
        cols, over_flags, spike_flags, comments = read(args.trace)
    except BadInput as e:
        fail(args.trace, e, 2)
    x, scale = cols["attempt"], cols["scale"]
    over = [(a, s) for a, s, o in zip(x, scale, over_flags) if o]
    spikes = [(a, s) for a, s, k in zip(x, scale, spike_flags) if k]
    finite_norm = [(a, g) for a, g in zip(x, cols["norm"]) if math.isfinite(g) and g > 0]

    fig, ax = plt.subplots(4, 1, sharex=True, figsize=(9, 10), constrained_layout=True)
    title = args.title or describe(args.trace) or (comments[0] if comments else args.trace)
    fig.suptitle(textwrap.fill(title, 100), fontsize=9)

    ax[0].plot(x, cols["loss"], lw=0.8, color="tab:blue", label="loss")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("loss (MSE)", color="tab:blue")
    lr_ax = ax[0].twinx()
    lr_ax.plot(x, cols["lr"], lw=1.0, color="tab:brown", ls="--", label="learning rate")
    lr_ax.set_yscale("log")
    lr_ax.set_ylabel("learning rate", color="tab:brown")

    ax[1].step(x, scale, where="post", lw=1.0, color="tab:green", label="loss scale")
    if over:
        ax[1].scatter(*zip(*over), marker="x", color="tab:red", s=18, zorder=3,
                      label=f"overflow, step skipped ({len(over)})")
    if spikes:
        ax[1].scatter(*zip(*spikes), marker="o", facecolors="none", edgecolors="tab:orange",
                      s=60, zorder=3, label=f"gradient spike ({len(spikes)})")
    ax[1].set_ylabel("log2 loss scale")
    ax[1].legend(loc="best", fontsize=8)

    if finite_norm:
        ax[2].plot(*zip(*finite_norm), lw=0.6, color="tab:olive")
    ax[2].set_yscale("log")
    ax[2].set_ylabel("gradient norm\n(unscaled, before clipping)")

    ax[3].plot(x, cols["sub"], lw=0.8, color="tab:purple", label="subnormal")
    ax[3].plot(x, cols["zero"], lw=0.8, color="tab:gray", label="zero")
    ax[3].set_yscale("symlog", linthresh=1e-3)  # shares from 0 to 100% over many decades
    ax[3].set_ylim(0, 100)
    ax[3].set_ylabel("gradient elements (%)")
    ax[3].set_xlabel("step (attempt)")
    ax[3].legend(loc="best", fontsize=8)
    # Written through a file this script opens and closes, so that a failed write (a full disk,
    # /dev/full), which the image writers do not all report, fails here.
    try:
        with open(args.output, "wb") as f:
            fig.savefig(f, format=extension, dpi=120)
    except OSError as e:
        fail(args.output, e.strerror or e, 1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

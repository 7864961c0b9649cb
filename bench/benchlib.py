"""What the scripts in bench/ share: their command line, matplotlib when it is there, a host timer."""

import argparse
import json
import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def arguments(doc, name, steps, extra=None):
    """--steps, --out and --plot-only (and what extra(parser) adds); args.json and args.png are
    the result files NAME.json and NAME.png in --out, which is created."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON file")
    if extra:
        extra(ap)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.json, args.png = os.path.join(args.out, name + ".json"), os.path.join(args.out, name + ".png")
    return args


def save(results, args, plot):
    """Writes the results to args.json, then draws them with plot(results, args.png)."""
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", args.json)
    plot(results, args.png)


def redraw(args, plot):
    """With --plot-only, draws the saved results and says so (True); otherwise False."""
    if not args.plot_only:
        return False
    with open(args.json) as f:
        plot(json.load(f), args.png)
    return True


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said once) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: no plot (rerun with --plot-only where it is)")
        return None


def write_figure(fig, path):
    """Lays out `fig`, writes it to `path` (110 dpi) and says so."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def median_ms(fn, repeats, warmup=2):
    """The median of `repeats` calls of fn (each returning when its work is done), in ms by the
    host clock, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def paired_ms(fa, fb, repeats, warmup=2):
    """Times fa and fb in turns (a b, then b a, and so on: a drift of the machine's speed during
    the run weighs on both alike), after `warmup` calls of each. Returns the median time of each
    in ms and the median of the ratios a/b of the pairs (a pair is the two calls next to each
    other, so a slow second slows both of them)."""
    for _ in range(warmup):
        fa()
        fb()
    ta, tb = [], []
    for r in range(repeats):
        for fn, times in ((fa, ta), (fb, tb)) if r % 2 == 0 else ((fb, tb), (fa, ta)):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ta), statistics.median(tb), statistics.median(a / b for a, b in zip(ta, tb))

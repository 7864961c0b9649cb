#!/usr/bin/env python3
"""Runs halfstep-train as the README's main command does (on the CPU engine) and checks that the
README's sample output is what it prints: every line of the sample, with the timings (steps/s and
seconds, which depend on the machine) left out, must be a line of the output, in order.

usage: check_readme_sample.py README.md HALFSTEP_TRAIN"""
import re
import subprocess
import sys


def sample(readme):
    """The lines of the README's sample output: the first fenced block after 'Its output'."""
    text = open(readme, encoding="utf-8").read()
    at = text.find("Its output on a machine without a GPU")
    if at < 0:
        sys.exit("README.md: no sample output ('Its output on a machine without a GPU') found")
    block = re.search(r"```\n(.*?)```", text[at:], re.S)
    if not block:
        sys.exit("README.md: the sample output is not a fenced block")
    return [line for line in block.group(1).splitlines() if line.strip() and line.strip() != "..."]


def untimed(line):
    """A line without what depends on the machine's speed."""
    line = re.sub(r"\s+[0-9.]+ steps/s$", "", line.rstrip())
    return re.sub(r"in [0-9.]+ s \([0-9.]+ steps/s\)", "in T s", line)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    expected = [untimed(line) for line in sample(sys.argv[1])]
    run = subprocess.run([sys.argv[2], "--cpu"], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit("halfstep-train --cpu failed (%d):\n%s%s" % (run.returncode, run.stdout, run.stderr))
    got = [untimed(line) for line in run.stdout.splitlines()]
    # The first line says why the CPU engine runs: the README was made without a GPU, this run
    # asks for the CPU with --cpu.
    expected[0] = re.sub(r"^no CUDA device found:", "--cpu:", expected[0])
    at = 0
    for line in expected:
        while at < len(got) and got[at] != line:
            at += 1
        if at == len(got):
            print("the README's sample output says\n  %s\nwhich halfstep-train --cpu does not print (in this order);"
                  " it printed:\n%s" % (line, "\n".join("  " + g for g in got)))
            sys.exit(1)
        at += 1
    print("the README's %d sample lines are what halfstep-train --cpu prints" % len(expected))


if __name__ == "__main__":
    main()

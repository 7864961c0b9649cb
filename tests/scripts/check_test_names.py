#!/usr/bin/env python3
"""Fails if a Catch2 test name holds a character that catch_discover_tests cannot pass through
CTest intact: a ';' splits the name into a CMake list, so the CTest entry runs a filter that
matches no test case and passes without running it. Lists every such name.

usage: check_test_names.py TESTS_DIR"""
import pathlib
import re
import sys


def main():
    root = pathlib.Path(sys.argv[1])
    bad = []
    for path in sorted(root.rglob("*.cpp")):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r'TEST_CASE\(\s*"((?:[^"\\]|\\.)*)"', text):
            if ";" in m.group(1):
                bad.append("%s:%d: %s" % (path.relative_to(root), text.count("\n", 0, m.start()) + 1, m.group(1)))
    if bad:
        sys.exit("test names with ';' (CTest would run none of them):\n  " + "\n  ".join(bad))
    print("every test name reaches CTest whole")


if __name__ == "__main__":
    main()

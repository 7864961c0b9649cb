"""libhalfstep exports its public API and nothing else: every dynamic symbol it defines is a C API
function (halfstep_*), or lies in namespace halfstep outside halfstep::detail (with the typeinfo
and vtables of its public classes); every function halfstep.h declares is among them.

usage: check_exports.py LIBRARY HALFSTEP_H"""

import re
import subprocess
import sys


def main():
    library, header = sys.argv[1], sys.argv[2]
    out = subprocess.run(["nm", "-D", "--defined-only", "--demangle", library], check=True, capture_output=True,
                         text=True).stdout
    names = [line.split(" ", 2)[2] for line in out.splitlines() if line.count(" ") >= 2]
    public = re.compile(r"^(halfstep_[a-z0-9_]+|((typeinfo|typeinfo name|vtable) for )?halfstep::(?!detail::).+)$")
    foreign = [n for n in names if not public.match(n)]
    declared = set(re.findall(r"\b(halfstep_[a-z0-9_]+)\(", open(header).read()))
    missing = sorted(declared - set(names))
    if foreign or missing or not names:
        for n in foreign[:40]:
            print("exported but not public API:", n)
        for n in missing:
            print("declared in halfstep.h but not exported:", n)
        print("%d exported, %d not public, %d C functions missing" % (len(names), len(foreign), len(missing)))
        return 1
    cxx = sum(1 for n in names if "halfstep::" in n)
    print("%d symbols exported: %d C API functions, %d C++ API symbols; nothing else" %
          (len(names), len(names) - cxx, cxx))
    return 0


if __name__ == "__main__":
    sys.exit(main())

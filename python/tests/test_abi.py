"""The ctypes structs of halfstep._lib against the C structs of include/halfstep/halfstep.h: the
same structs, fields, order and types as the header declares, and the offsets and sizes the C
compiler gives them (tests/c/abi_layout.c, built by CMake; CTest passes its path in
HALFSTEP_ABI_LAYOUT). A field added on one side only fails here, not in a caller's memory."""

import ctypes as C
import json
import os
import pathlib
import re
import subprocess

import pytest

from halfstep import _lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "include/halfstep/halfstep.h"

# The ctypes struct that mirrors each struct of the header.
MIRRORS = {"halfstep_tensor": _lib.Tensor, "halfstep_group": _lib.Group, "halfstep_config": _lib.Config,
           "halfstep_report": _lib.Report, "halfstep_state": _lib.State, "halfstep_state_bytes": _lib.StateBytes,
           "halfstep_moment_blocks": _lib.MomentBlocks}
SCALARS = {"float": C.c_float, "double": C.c_double, "int32_t": C.c_int32, "int64_t": C.c_int64,
           "uint32_t": C.c_uint32, "uint64_t": C.c_uint64}


def header_structs(text):
    """Each struct defined in the header's text: its fields in order, as (name, C type), a pointer's
    type being "pointer". Refuses a declaration it cannot read rather than skip it."""
    code = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))
    bodies = re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", code, re.S)
    assert len(bodies) == len(re.findall(r"\bstruct\s+\w*\s*\{", code)), "a struct this test cannot read"
    structs = {}
    for name, body in bodies:
        fields = []
        for decl in body.split(";")[:-1]:
            m = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*(\*?)\s*(\w+(?:\s*,\s*\w+)*)\s*", decl)
            assert m, "%s: a declaration this test cannot read: %r" % (name, decl.strip())
            names = re.split(r"\s*,\s*", m.group(3))
            assert not (m.group(2) and len(names) > 1), "%s: several names after a pointer: %r" % (name, decl)
            fields += [(n, "pointer" if m.group(2) else m.group(1)) for n in names]
        structs[name] = fields
    return structs


def same_type(c_type, ctype):
    if c_type == "pointer":
        return ctype in (C.c_void_p, C.c_char_p) or issubclass(ctype, C._Pointer)
    return SCALARS.get(c_type) is ctype


def declaration_problems(structs):
    """How the ctypes structs differ from the header's declarations."""
    problems = []
    if set(structs) != set(MIRRORS):
        problems.append("halfstep.h defines %s, _lib.py mirrors %s" % (sorted(structs), sorted(MIRRORS)))
    for c_name, py in MIRRORS.items():
        declared = structs.get(c_name, [])
        c_names, py_names = [n for n, _ in declared], [n for n, _ in py._fields_]
        if c_names != py_names:
            problems.append("%s declares %s, _lib.%s %s" % (c_name, c_names, py.__name__, py_names))
            continue
        for (n, c_type), (_, ctype) in zip(declared, py._fields_):
            if not same_type(c_type, ctype):
                problems.append("%s.%s is %s in C, %s in _lib.%s"
                                % (c_name, n, c_type, ctype.__name__, py.__name__))
    return problems


def ctypes_layout(py):
    """A ctypes struct's layout in the form abi_layout.c prints."""
    fields = [getattr(py, n) for n, _ in py._fields_]
    return {"size": C.sizeof(py),
            "fields": [dict(name=n, offset=f.offset, size=f.size) for (n, _), f in zip(py._fields_, fields)]}


def layout_problems(layouts, structs):
    """How the ctypes structs' offsets and sizes differ from the C compiler's (`layouts`, as
    abi_layout.c prints them), and whether abi_layout.c lists every field the header declares."""
    problems = []
    for c_name, py in MIRRORS.items():
        c = layouts.get(c_name)
        if c is None:
            problems.append("abi_layout.c does not print %s" % c_name)
            continue
        listed, declared = [f["name"] for f in c["fields"]], [n for n, _ in structs.get(c_name, [])]
        if listed != declared:
            problems.append("abi_layout.c prints %s's fields as %s, halfstep.h declares %s"
                            % (c_name, listed, declared))
        compiled = [(f["name"], f["offset"], f["size"]) for f in c["fields"]]
        mirrored = [(f["name"], f["offset"], f["size"]) for f in ctypes_layout(py)["fields"]]
        if compiled != mirrored:
            problems.append("%s: (field, offset, size) are %s in C, %s in _lib.%s"
                            % (c_name, compiled, mirrored, py.__name__))
        if c["size"] != C.sizeof(py):
            problems.append("sizeof(%s) is %d, ctypes.sizeof(_lib.%s) %d"
                            % (c_name, c["size"], py.__name__, C.sizeof(py)))
    return problems


def test_the_ctypes_structs_declare_what_the_header_does():
    assert declaration_problems(header_structs(HEADER.read_text())) == []


def test_the_ctypes_structs_are_laid_out_as_the_c_compiler_does():
    program = os.environ.get("HALFSTEP_ABI_LAYOUT")
    if not program:
        pytest.skip("HALFSTEP_ABI_LAYOUT is not set: no C compiler's layout of halfstep.h to compare with "
                    "(CTest sets it to the halfstep_abi_layout program, tests/c/abi_layout.c)")
    out = subprocess.run([program], capture_output=True, text=True, check=True).stdout
    layouts = {s["struct"]: s for s in map(json.loads, out.splitlines())}
    assert layout_problems(layouts, header_structs(HEADER.read_text())) == []


def test_a_field_added_to_one_side_only_is_found():
    text = HEADER.read_text()
    grown = text.replace("} halfstep_state;", "  int32_t flags;\n} halfstep_state;")
    assert grown != text
    assert any(p.startswith("halfstep_state declares") for p in declaration_problems(header_structs(grown)))
    # What abi_layout.c prints when it lists the new field: one more field, a larger struct.
    layouts = {name: ctypes_layout(py) for name, py in MIRRORS.items()}
    assert layout_problems(layouts, header_structs(text)) == []
    state = layouts["halfstep_state"]
    state["fields"].append(dict(name="flags", offset=state["size"], size=4))
    state["size"] += 8
    problems = layout_problems(layouts, header_structs(grown))
    assert [p.split(":")[0].split()[0] for p in problems] == ["halfstep_state", "sizeof(halfstep_state)"]
    # ... and when it does not: the header's field is missing from its list.
    state["fields"].pop()
    problems = layout_problems(layouts, header_structs(grown))
    assert problems[0].startswith("abi_layout.c prints halfstep_state's fields")

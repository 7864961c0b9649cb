"""The README's PyTorch snippet (the python block under "### From PyTorch"), run as written."""

import contextlib
import io
import pathlib
import re

import pytest

pytest.importorskip("torch")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_pytorch_snippet_runs():
    text = README.read_text()
    match = re.search(r"### From PyTorch\n.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md has no python block under '### From PyTorch'"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(match.group(1), "README.md", "exec"), {})
    printed = out.getvalue()
    assert "'outcome': 'applied'" in printed, printed

"""The README's PyTorch snippet (the python block under "### From PyTorch"), run as written."""

import contextlib
import io
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

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
    if not torch.cuda.is_available():  # bf16: no loss scale, and bf16's range measured (as the README says)
        report = eval(printed.strip().splitlines()[-1], {"nan": float("nan"), "inf": float("inf")})
        assert report["scale_used"] == 1.0 and report["headroom_log2"] > 100, report

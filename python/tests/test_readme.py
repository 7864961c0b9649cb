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


def test_readme_lean_state_snippet_builds_the_formats_it_names():
    text = README.read_text()
    match = re.search(r"### Lean optimizer state\n.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md has no python block under '### Lean optimizer state'"
    import halfstep.torch
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    scope = {"torch": torch, "halfstep": halfstep, "model": model}
    exec(compile(match.group(1), "README.md", "exec"), scope)
    opt = scope["opt"]
    model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    state = opt.state[model[0].weight]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    assert opt.last_report()["outcome"] == "applied"
    lean = halfstep.state_bytes(halfstep.config(dtype="bfloat16", master="bf16_remainder", exp_avg="bf16",
                                                exp_avg_sq="bf16"))
    assert (lean["state"], lean["state"] + lean["gradient"] + lean["model"], lean["moved"]) == (6, 10, 20), lean
    assert "| 10 | 20 |" in text  # the README's table says so
    bare = halfstep.state_bytes(halfstep.config(dtype="bfloat16", master="none", exp_avg="bf16", exp_avg_sq="bf16"))
    assert (bare["state"], bare["state"] + bare["gradient"] + bare["model"], bare["moved"]) == (4, 8, 16), bare
    assert "| none, bf16 | 4 | 8 | 16 |" in text  # the row without a master

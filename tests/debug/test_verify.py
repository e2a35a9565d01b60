"""``verify=True`` on graphs whose compiled result really differs from eager, in outputs and in gradients, and the
dtype-following tolerance."""

import json

import pytest
import torch

from npu_compile import backend
from npu_compile.debug.verify import RTOL, compare


class Block(torch.nn.Module):
    def __init__(self, h=32, dtype=torch.float32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h, dtype=dtype)
        self.fc1 = torch.nn.Linear(h, 4 * h, dtype=dtype)
        self.fc2 = torch.nn.Linear(4 * h, h, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _perturb(kind_wanted: str, factor: float):
    """An aten stage that scales the first output of the ``kind_wanted`` graph: a deliberately wrong compile."""

    def stage(gm, opts, kind):
        if kind != kind_wanted:
            return
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = next(a for a in out.args[0] if a is not None)
        with gm.graph.inserting_before(out):
            wrong = gm.graph.call_function(torch.ops.aten.mul.Tensor, (first, factor))
        out.args = (tuple(wrong if a is first else a for a in out.args[0]),)
        gm.recompile()

    return stage


def _add_stage(monkeypatch, stage):
    """One more aten stage after the backend's own, on every graph."""
    stages = backend.aten_stages
    monkeypatch.setattr(backend, "aten_stages", lambda target: [*stages(target), ("wrong", stage)])


def _verify(tmp_path, model, x, **opts):
    cm = torch.compile(model, backend="ascend", options={"verify": True, "dump_dir": str(tmp_path), **opts})
    cm(x).float().sum().backward()
    return json.loads((tmp_path / "0_0" / "report.json").read_text())["verify"]


def test_a_right_compile_passes_outputs_and_gradients(tmp_path):
    v = _verify(tmp_path, Block(), torch.randn(2, 8, 32, requires_grad=True))
    assert v["ok"] is True and v["tolerance"] == {"float32": 1e-5}
    assert v["gradients"]["ok"] is True and v["gradients"]["tolerance"] == {"float32": 1e-5}
    assert v["gradients"]["max_abs_diff"] < 1e-5


def test_a_wrong_forward_is_caught(tmp_path, monkeypatch):
    _add_stage(monkeypatch, _perturb("forward", 1.001))
    v = _verify(tmp_path, Block(), torch.randn(2, 8, 32, requires_grad=True))
    assert v["ok"] is False and v["why"].startswith("output 0 (2, 8, 32): element ")
    assert 5e-4 < v["max_rel_diff"] < 2e-3


def test_a_wrong_backward_is_caught(tmp_path, monkeypatch):
    """The forward is right; only the first gradient the backward graph returns is off by 1e-3."""
    _add_stage(monkeypatch, _perturb("backward", 1.001))
    v = _verify(tmp_path, Block(), torch.randn(2, 8, 32, requires_grad=True))
    assert v["max_abs_diff"] < 1e-5  # outputs agree
    assert v["ok"] is False and v["gradients"]["ok"] is False
    assert v["why"].startswith("gradient ") and 5e-4 < v["gradients"]["max_rel_diff"] < 1e-2


class RmsBlock(torch.nn.Module):
    """A hand-written RMSNorm then a linear, in bf16: the fused norm keeps fp32 statistics, eager rounds each op."""

    def __init__(self, h=64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(h, dtype=torch.bfloat16))
        self.fc = torch.nn.Linear(h, h, dtype=torch.bfloat16)

    def forward(self, x):
        return self.fc(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w)


def test_bf16_is_judged_against_float64(tmp_path):
    """Compiled and eager bf16 differ by more than bf16's tolerance in the weight gradient (eager is the worse
    of the two against float64): that passes, and the figures say why."""
    torch.manual_seed(0)
    v = _verify(tmp_path, RmsBlock(), torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True))
    assert v["ok"] is True, v
    assert v["tolerance"] == {"bfloat16": RTOL[torch.bfloat16]}
    g = v["gradients"]
    assert g["ok"] is True and g["max_abs_diff"] > 0.05
    assert g["against_float64"]["compiled_err_vs_float64"] < g["against_float64"]["eager_err_vs_float64"]


def test_a_wrong_bf16_backward_is_caught(tmp_path, monkeypatch):
    _add_stage(monkeypatch, _perturb("backward", 1.25))
    torch.manual_seed(0)
    v = _verify(tmp_path, RmsBlock(), torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True))
    assert v["ok"] is False and v["gradients"]["ok"] is False and v["why"].startswith("gradient ")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_ulp_passes_and_ten_percent_fails(dtype):
    e = torch.linspace(-3, 3, 64, dtype=dtype)
    ulp = torch.nextafter(e, torch.full_like(e, 10))
    assert compare(e, ulp)["ok"] is True
    if dtype == torch.float32:  # the old fixed 1e-5 held half types to fp32's bar; fp32 keeps it
        assert compare(e, e * (1 + 3e-5))["ok"] is False
    wrong = e.clone()
    wrong[40] *= 1.1
    result = compare(e, wrong)
    assert result["ok"] is False and result["why"].startswith("output 0 (64,): element 40 is ")


def test_nan_on_one_side_fails():
    e = torch.ones(4)
    assert compare(e, torch.tensor([1.0, float("nan"), 1.0, 1.0]))["ok"] is False
    assert compare(torch.full((2,), float("nan")), torch.full((2,), float("nan")))["ok"] is True

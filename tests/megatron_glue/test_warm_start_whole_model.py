"""The whole model warm-starts: ``npu_compile.precompile.compile(gpt_model)`` after ``megatron_glue.adapt()`` (its
"regions" group: the layers one nested compile region, called through invoke_subgraph) stores one artifact, and a
second process loads it — the region's lowered forward and backward inside aot_autograd's entry, Dynamo's guards
around the outer frame — and trains with no Dynamo trace and no aot_autograd trace, bitwise as the first process
did, its report.json (the region's row included) given again as "precompiled"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch

VOCAB, SEQ, BATCH, LAYERS, STEPS = 128, 32, 2, 2, 2

_CHILD = r"""
import json, sys, torch
from torch._dynamo.utils import counters
import megatron_glue
from megatron_glue.capture import models
from megatron_glue.capture.adaptations import groups_for, registry
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from npu_compile import precompile
from npu_compile.debug.report import collect
VOCAB, SEQ, BATCH, LAYERS, STEPS = (int(a) for a in sys.argv[2:7])
layers = sys.argv[7] == "layers"  # megatron_glue.compile_layers under adapt()'s default, else the regions model
megatron_glue.adapt(groups_for(one_graph=not layers)); models.init_single_process()
model = build_gpt_model(gpt_config(hidden_size=64, num_layers=LAYERS), VOCAB, SEQ, seed=0)
compiled = megatron_glue.compile_layers(model, {"cache": True}) if layers else precompile.compile(model, {"cache": True})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
history = []
with collect() as reports:
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = compiled(**synthetic_batch(BATCH, SEQ, VOCAB, seed=step))
        out.mean().backward()
        history.append([out.detach(), *[p.grad.clone() for p in model.parameters()]])
        opt.step()
torch.save(history, sys.argv[1])
print(json.dumps({"precompile": dict(precompile.counts), "graphs": counters["stats"]["unique_graphs"],
                  "aot_autograd": counters["aot_autograd"]["total"],
                  "regions_group": any(registry.get(n).group == "regions" for n in registry.applied()),
                  "reports": [{"cache": r.cache, "regions": r.regions, "fusions": r.fusions,
                               "reused_by": r.reused_by} for r in reports]}))
"""


def _process(tmp_path, name, mode="regions"):
    env = dict(os.environ, NPU_COMPILE_CACHE_DIR=str(tmp_path / "cache"), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / f"{name}.pt"),
                           *map(str, (VOCAB, SEQ, BATCH, LAYERS, STEPS)), mode],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(tmp_path / f"{name}.pt")


def test_the_whole_model_with_regions_starts_warm_in_a_second_process(megatron_cpu, tmp_path):
    cold, cold_history = _process(tmp_path, "cold")
    assert cold["regions_group"]
    # one artifact, for the whole model: a graph break or an artifact that did not serialize would fall back
    assert cold["precompile"] == {"compiled": 1, "stored": 1, "hit": STEPS - 1}, cold
    assert cold["graphs"] == 1 and cold["aot_autograd"] == 1
    stored = sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache" / "precompiled").rglob("*"))
    (report,) = cold["reports"]
    ((region_name, region),) = report["regions"].items()
    assert region["calls"] == LAYERS and region["fusions"]["attention"] == 1

    warm, warm_history = _process(tmp_path, "warm")
    # no Dynamo trace, no aot_autograd trace, nothing compiled or stored: the artifact ran both steps
    assert (warm["precompile"], warm["graphs"], warm["aot_autograd"]) == ({"loaded": 1, "hit": STEPS}, 0, 0), warm
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache" / "precompiled").rglob("*")) == stored
    # the loaded compile's report.json: the same regions and fusions, every step marked as loaded
    (loaded,) = warm["reports"]
    assert loaded["regions"] == report["regions"] and loaded["fusions"] == report["fusions"]
    assert set(loaded["cache"]) == set(report["cache"]) >= {"region_partition", "forward", "backward"}
    assert set(loaded["cache"].values()) == {"precompiled"}
    # bitwise the first process's losses and gradients, step by step
    assert len(warm_history) == STEPS
    for step, (a, b) in enumerate(zip(cold_history, warm_history)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    _assert_eager(warm_history)


def _assert_eager(history):
    """Each step's loss and gradients equal eager's within float tolerance (fused ops)."""
    eager = build_gpt_model(gpt_config(hidden_size=64, num_layers=LAYERS), VOCAB, SEQ, seed=0)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = eager(**synthetic_batch(BATCH, SEQ, VOCAB, seed=step))
        out.mean().backward()
        expected = [out.detach(), *[p.grad for p in eager.parameters()]]
        for i, (x, y) in enumerate(zip(history[step], expected, strict=True)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} tensor {i}: {m}")
        opt.step()


def test_the_layers_compiled_as_the_job_does_start_warm_in_a_second_process(megatron_cpu, tmp_path):
    """megatron_glue.compile_layers under adapt()'s default groups: the embedding, the layer (one artifact for
    both layers) and the output layer with the loss each stored once; a second process loads the three, traces
    nothing, and trains bitwise as the first did."""
    cold, cold_history = _process(tmp_path, "cold", "layers")
    assert not cold["regions_group"]
    assert cold["precompile"] == {"compiled": 3, "stored": 3, "hit": 3 * STEPS + (LAYERS - 1) * STEPS - 3}, cold
    assert cold["graphs"] == 3 and cold["aot_autograd"] == 3
    (layer,) = [r for r in cold["reports"] if r["fusions"].get("attention")]
    assert layer["reused_by"] == LAYERS
    warm, warm_history = _process(tmp_path, "warm", "layers")
    assert (warm["precompile"], warm["graphs"], warm["aot_autograd"]) == (
        {"loaded": 3, "hit": 3 * STEPS + (LAYERS - 1) * STEPS}, 0, 0), warm
    for step, (a, b) in enumerate(zip(cold_history, warm_history, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"
    _assert_eager(warm_history)

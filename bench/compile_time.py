"""First-step compile time of a megatron-core GPT (hidden 128, seq 128) at 2, 8 and 32 layers, per-layer compiled
as the training job does (megatron_glue.training.training.compile_model): backend="ascend" cold, "ascend" warm (a second
process on the persistent cache: npu_compile.precompile loads each compile, Dynamo and aot_autograd trace nothing),
and Inductor cold, each in a fresh subprocess with its own empty caches; and compiled whole as the README's usage
does (`megatron_glue.adapt()` then `torch.compile(gpt_model)`), cold: each layer a frame of its own (adapt()'s
default "layer_frames" group), the layers as one nested compile region (`groups_for(one_graph=True)`, the "regions"
group) and with them inlined (neither); and the regions model through the README's warm-start entry
(`npu_compile.precompile.compile(gpt_model)`, which needs one graph), cold and then warm in a second process on the
first's cache.

    python -m bench.compile_time                # writes bench/results/compile_time.md and .png
    python -m bench.compile_time --whole-model  # only the whole-model table (with the job's cold and warm runs
                                                # beside it), replacing that section of compile_time.md
    python -m bench.compile_time --phases       # where the whole-model first step goes, at 2 and 32 layers
                                                # (bench/results/compile_time_phases.md)
    python -m bench.compile_time --ordering     # the memory ordering on the whole model's graphs at 2 to 64 layers:
                                                # its time per node stays flat (bench/results/compile_time_ordering.md)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS = (2, 8, 32)
RESULTS = Path(__file__).parent / "results"

_CHILD = r"""
import json, sys, time, types
import torch
from megatron_glue.capture import adapt, models
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from megatron_glue.training.training import compile_model
from npu_compile.debug.report import collect
adapt(("cpu", "compile")); models.init_single_process()
layers, backend = int(sys.argv[1]), sys.argv[2]
model = build_gpt_model(gpt_config(hidden_size=128, num_attention_heads=4, num_layers=layers), 128, 128)
if backend == "ascend":
    compile_model(model, types.SimpleNamespace(npu_compile_options={}))
else:
    for m in [*model.decoder.layers, model.embedding, model.output_layer]:
        m.forward = torch.compile(m.forward, backend=backend)
batch = synthetic_batch(2, 128, 128)
t = time.perf_counter()
with collect() as reports:
    model(**batch).mean().backward()
first = time.perf_counter() - t
t = time.perf_counter()
model(**batch).mean().backward()  # the step without compiling: what a warm first step cannot save
second = time.perf_counter() - t
parts = {}
for r in reports:
    for k, v in r.compile_s.items():
        parts[k] = parts.get(k, 0.0) + v
from npu_compile import precompile
print(json.dumps({"first_step_s": first, "second_step_s": second, "parts": parts, "precompile": dict(precompile.counts),
                  "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
"""


# The whole model under torch.compile, as the README's usage: adapt() (layer frames, regions, or neither), then
# torch.compile(gpt_model, backend="ascend"), the backend's cache off, torch's caches off; or ("precompiled") with
# regions through the README's warm-start entry, npu_compile.precompile.compile(gpt_model), the backend's cache on.
_WHOLE_CHILD = r"""
import json, sys, time
import torch
import megatron_glue
from megatron_glue.capture import models
from megatron_glue.capture.adaptations import groups_for
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from npu_compile import precompile
from npu_compile.debug.report import collect
layers, mode = int(sys.argv[1]), sys.argv[2]
# "frames": adapt()'s default, each layer its own frame; "inlined": neither layer_frames nor regions; the rest regions
groups = groups_for(one_graph=mode not in ("frames", "inlined"))
megatron_glue.adapt(tuple(g for g in groups if mode != "inlined" or g not in ("regions", "layer_frames")))
backend = "ascend"
if mode == "torch":  # torch's own share: Dynamo, and aot_autograd called as the backend calls it, compiling nothing
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from npu_compile import passes, regions

    def backend(gm, example_inputs):
        with regions.schema_once_per_region():
            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                partition_fn=min_cut_rematerialization_partition,
                                decompositions=passes.decompositions(), keep_inference_input_mutations=True,
                                )(gm, example_inputs)
models.init_single_process()
model = build_gpt_model(gpt_config(hidden_size=128, num_attention_heads=4, num_layers=layers), 128, 128)
if mode == "precompiled":
    compiled = precompile.compile(model, {"cache": True})
else:
    compiled = torch.compile(model, backend=backend, **({"options": {"cache": False}} if mode != "torch" else {}))
batch = synthetic_batch(2, 128, 128)
t = time.perf_counter()
with collect() as reports:
    compiled(**batch).mean().backward()
first = time.perf_counter() - t
t = time.perf_counter()
compiled(**batch).mean().backward()  # the step itself, which grows with the layers whatever the compile does
second = time.perf_counter() - t
parts = {}
for r in reports:
    for k, v in r.compile_s.items():
        parts[k] = parts.get(k, 0.0) + v
counters = torch._dynamo.utils.counters
print(json.dumps({"first_step_s": first, "second_step_s": second, "unique_graphs": counters["stats"]["unique_graphs"],
                  "aot_autograd": counters["aot_autograd"]["total"], "precompile": dict(precompile.counts),
                  "parts": parts, "regions": {k: v for r in reports for k, v in r.regions.items()},
                  "graphs": len(reports), "reused_by": max((r.reused_by for r in reports), default=0),
                  "attention": sum(r.fusions.get("attention", 0) for r in reports)}))
"""


def run_whole(layers: int, mode: str, cache_dir: str | None = None) -> dict:
    """First step of the whole model in a fresh process, ``mode`` "frames" (adapt()'s default: each layer a frame of
    its own), "regions" (adapt(groups_for(one_graph=True))) or "inlined" (neither: every layer traced again; these
    three through torch.compile, every cache empty or off), "torch" (regions through Dynamo and aot_autograd called
    as the backend calls it: the min-cut partition, the decompositions, the region schema memo, graphs compiled to
    themselves and nothing else of ours: what torch alone costs) or "precompiled" (regions through
    npu_compile.precompile.compile on ``cache_dir``: cold when it is empty, warm when a "precompiled" run filled it;
    torch's caches empty, the FX graph cache off)."""
    with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache_dir or fresh,
                   TORCHINDUCTOR_CACHE_DIR=inductor, TORCHINDUCTOR_FX_GRAPH_CACHE="0", PYTHONWARNINGS="ignore")
        if mode != "precompiled":  # precompile stores only with it on, and answers no lookup from it
            env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
        done = subprocess.run([sys.executable, "-c", _WHOLE_CHILD, str(layers), mode],
                              env=env, capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parent.parent)
    if done.returncode:
        raise RuntimeError(f"whole model ({mode}) at {layers} layers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_whole_warm(layers: int) -> tuple[dict, dict]:
    """The regions model through npu_compile.precompile.compile: cold on an empty cache, then warm, a second process
    on the first's cache; the warm one must have traced nothing (no Dynamo graph, no aot_autograd trace)."""
    with tempfile.TemporaryDirectory() as cache:
        cold = run_whole(layers, "precompiled", cache)
        warm = run_whole(layers, "precompiled", cache)
    if cold["precompile"].get("stored") != 1:
        raise RuntimeError(f"the whole model at {layers} layers stored no artifact: {cold['precompile']}")
    if warm["unique_graphs"] or warm["aot_autograd"] or warm["precompile"].get("compiled"):
        raise RuntimeError(f"the whole model's warm run at {layers} layers traced again: {warm}")
    return cold, warm


def run_job(layers: int) -> tuple[dict, dict]:
    """The job's per-layer compile, cold and then warm (a second process on the first's cache)."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as ind:
        cold = run(layers, "ascend", cache, ind)
        warm = run(layers, "ascend", cache, ind)
    if warm["unique_graphs"] or warm["precompile"].get("compiled"):
        raise RuntimeError(f"the job's warm run at {layers} layers traced again: {warm}")
    return cold, warm


def whole_model_lines(rows: list[tuple[int, dict, dict, dict, dict, dict, dict, dict, dict]]) -> list[str]:
    """The whole-model table: (layers, layer frames, regions, inlined, the job's cold run, the job's warm run, the
    regions model through precompile cold, and warm, the regions model through torch alone) per row."""
    base_f, base_r, base_i = (rows[0][k]["first_step_s"] for k in (1, 2, 3))
    lines = ["", WHOLE_HEADING, "",
             "`adapt()`'s default, each layer a frame of its own (its \"layer_frames\" group: the block's loop left "
             "to Python, the layer's frame compiled once and run by every layer of its structure), beside the layers "
             "as one nested compile region in the model's one graph (`adapt(groups_for(one_graph=True))`, its "
             "\"regions\" group: traced once, compiled once, called N times), the same model with its layers inlined "
             "(neither group: every layer traced and compiled again), and the job's per-layer compile from the table "
             "above; each a fresh process with the backend's and torch's caches off. The first step runs the step "
             "too: \"2nd step\" is the next step in the same process, and \"first - 2nd\" what is left of the first "
             "step without it. \"graphs\" is the layer-frames model's compiled graphs, \"run by\" how many layers "
             "ran its layer graph (report.json `reused_by`). \"precompile cold\" is the regions model through the "
             "warm-start entry, `npu_compile.precompile.compile(gpt_model)`, on an empty cache (it stores one "
             "artifact: the outer frame's guards and code, aot_autograd's entry with the region's lowered forward and "
             "backward); \"warm\" a second process on that cache, which traces nothing (no Dynamo graph, no "
             "aot_autograd trace; checked); \"job warm\" the same for the job's per-layer compile.",
             "",
             "| layers | layer frames (s) | vs 2 layers | 2nd step (s) | first - 2nd (s) | vs 2 layers | graphs "
             "| run by | regions (s) | vs 2 layers | regions 2nd step (s) | inlined (s) | vs 2 layers | job cold (s) "
             "| precompile cold (s) | warm (s) | warm / cold | job warm (s) | job warm / cold | region calls "
             "| attention fused |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base_c = base_f - rows[0][1]["second_step_s"]
    for layers, fr, reg, inl, job, job_warm, pc, pw, _ in rows:
        f, s = fr["first_step_s"], fr["second_step_s"]
        r, i = reg["first_step_s"], inl["first_step_s"]
        j, jw, c, w = (x["first_step_s"] for x in (job, job_warm, pc, pw))
        calls = sum(v["calls"] for v in reg["regions"].values())
        lines.append(f"| {layers} | {f:.2f} | {f / base_f:.2f}x | {s:.2f} | {f - s:.2f} | {(f - s) / base_c:.2f}x "
                     f"| {fr['graphs']} | {fr['reused_by']} | {r:.2f} | {r / base_r:.2f}x | {reg['second_step_s']:.2f} "
                     f"| {i:.2f} | {i / base_i:.2f}x | {j:.2f} | {c:.2f} | {w:.2f} | {w / c:.2f} | {jw:.2f} "
                     f"| {jw / j:.2f} | {calls} | {reg['attention']} |")

    def compile_s(r: dict) -> float:  # the first step less the step itself
        return r["first_step_s"] - r["second_step_s"]

    ours0, torch0 = compile_s(rows[0][2]), compile_s(rows[0][8])
    lines += ["", "What torch alone costs as the layers grow: the same regions model through Dynamo (its tracing "
              "with its region reuse) and aot_autograd called as the backend calls it (the same decompositions, "
              "torch's min-cut partition, the region schema memo), each graph \"compiled\" to itself: none of the "
              "backend's passes, lowering or executor; each a fresh process. Columns are the first step less the "
              "second (the compile alone). "
              "\"floor\" is the ascend 2-layer figure plus torch's own growth since 2 layers: what the regions model "
              "would take at that size if everything of ours stayed as at 2 layers, over the 2-layer figure.", "",
              "| layers | torch alone: first - 2nd (s) | its growth since 2 layers (s) | ascend first - 2nd (s) "
              "| its growth (s) | floor vs 2 layers |", "|---|---|---|---|---|---|"]
    for layers, _, reg, *_, tor in rows:
        t, o = compile_s(tor), compile_s(reg)
        lines.append(f"| {layers} | {t:.2f} | {t - torch0:+.2f} | {o:.2f} | {o - ours0:+.2f} "
                     f"| {(ours0 + t - torch0) / ours0:.2f}x |")
    return lines


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with ``header``, one list per row."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def plot(path: Path) -> None:
    """compile_time.png from the tables in ``path`` as they stand: the job's section and the whole-model section may
    come from different runs (``--whole-model`` rewrites the second), and the plot shows what the file says."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    text = path.read_text()
    job = _table(text, "| layers | ascend cold (s)")
    whole = _table(text, "| layers | layer frames (s)")
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, rows, col, style in (("job, cold", job, 1, "-"), ("job, warm", job, 3, "-"),
                                    ("inductor cold, per layer", job, 6, "-"),
                                    ("whole model, layer frames", whole, 1, "--"),
                                    ("whole model, regions", whole, 8, "--"), ("whole model, inlined", whole, 11, "--"),
                                    ("whole model (regions), warm", whole, 15, "--")):
        xs = [int(r[0]) for r in rows]
        ax.plot(xs, [float(r[col]) for r in rows], marker="o" if style == "-" else "s", linestyle=style, label=label)
    ax.set(xlabel="transformer layers", ylabel="first step (s)", xscale="log", title="first-step compile time")
    ax.minorticks_off()
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)  # beside the lines, not over them
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100, bbox_inches="tight")


WHOLE_PREFIX = "## `adapt()` + `torch.compile(gpt_model)`: the whole model"
WHOLE_HEADING = f"{WHOLE_PREFIX}, cold and warm"


def whole_model_main(layer_counts: tuple[int, ...] = LAYERS) -> None:
    """The whole-model rows alone, each beside the job's cold and warm runs of the same size in the same run."""
    rows = []
    for layers in layer_counts:
        job = run_job(layers)
        rows.append((layers, run_whole(layers, "frames"), run_whole(layers, "regions"), run_whole(layers, "inlined"),
                     *job, *run_whole_warm(layers), run_whole(layers, "torch")))
        print(layers, rows[-1][1:], flush=True)
    path = RESULTS / "compile_time.md"
    kept = path.read_text().split("\n" + WHOLE_PREFIX)[0].rstrip("\n").split("\n") if path.exists() else []
    path.write_text("\n".join(kept + whole_model_lines(rows)) + "\n")
    plot(path)
    print(path.read_text())


# The whole model's first step (regions) under cProfile with the main thread's CPU clock (load on a shared machine
# stretches wall time, not this), then its second step; each phase a function's cumulative time and its calls.
_PHASES_CHILD = r"""
import cProfile, json, pstats, sys, time
import torch
import megatron_glue
from megatron_glue.capture import models
from megatron_glue.capture.adaptations import groups_for
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
layers = int(sys.argv[1])
megatron_glue.adapt(groups_for(one_graph=True)); models.init_single_process()
model = build_gpt_model(gpt_config(hidden_size=128, num_attention_heads=4, num_layers=layers), 128, 128)
compiled = torch.compile(model, backend="ascend", options={"cache": False})
batch = synthetic_batch(2, 128, 128)
profile = cProfile.Profile(time.thread_time)
profile.enable()
compiled(**batch).mean().backward()
profile.disable()
c = time.thread_time()
compiled(**batch).mean().backward()
second = time.thread_time() - c
stats = pstats.Stats(profile).stats
total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
found, first = {}, {}
for (path, line, name), (_, calls, _, cum, _) in stats.items():
    for phase, (where, fn) in json.loads(sys.argv[2]).items():
        # the first function of that name in the file (a method, not a closure of the same name inside it)
        if path.replace("\\", "/").endswith(where) and name == fn and line < first.get(phase, 1 << 30):
            first[phase], found[phase] = line, (calls, cum)
print(json.dumps({"total": total, "second_step_cpu": second, "phases": found}))
"""

# (phase, (file, function)): torch's and the backend's steps of the first step, outermost first
PHASES = {
    "Dynamo: the frame's whole compile": ("torch/_dynamo/convert_frame.py", "_compile"),
    "Dynamo: fingerprint a region call's arguments": ("torch/_dynamo/variables/invoke_subgraph.py",
                                                     "build_input_fingerprint"),
    "Dynamo: check a traced region's guards for reuse": ("torch/_dynamo/variables/invoke_subgraph.py",
                                                          "find_reuse_match"),
    "Dynamo: stamp out a reused region call": ("torch/_dynamo/variables/invoke_subgraph.py", "stamp_out_subgraph"),
    "the backend (aot_autograd and ours)": ("npu_compile/backend.py", "ascend"),
    "aot_autograd: trace metadata and joint graph": ("torch/_functorch/_aot_autograd/graph_compile.py",
                                                     "aot_stage1_graph_capture"),
    "aot_autograd: invoke_subgraph.gen_schema (retraces the region)": ("torch/_higher_order_ops/invoke_subgraph.py",
                                                                        "gen_schema"),
    "ours: partition (rules + min-cut), region and outer": ("npu_compile/backend.py", "partition"),
    "ours: the region's joint (rules + min-cut)": ("npu_compile/backend.py", "_partition_region"),
    "torch's min-cut partitioner (called by ours)": ("torch/_functorch/partitioners.py",
                                                     "min_cut_rematerialization_partition"),
    "ours: memory ordering (reorder_for_peak)": ("npu_compile/passes/reorder.py", "reorder_for_peak"),
    "ours: a forward / backward graph's stages and lowering": ("npu_compile/backend.py", "compile_graph"),
    "running the first step (executor)": ("npu_compile/precompile.py", "__call__"),
}


def phases_main() -> None:
    """bench/results/compile_time_phases.md: the whole model's first step at 2 and 32 layers, by phase."""
    got = {}
    for layers in (2, 32):
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
            env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache,
                       TORCHINDUCTOR_CACHE_DIR=inductor, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                       TORCHINDUCTOR_AUTOGRAD_CACHE="0", PYTHONWARNINGS="ignore")
            done = subprocess.run([sys.executable, "-c", _PHASES_CHILD, str(layers), json.dumps(PHASES)], env=env,
                                  capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parent.parent)
        if done.returncode:
            raise RuntimeError(f"phases at {layers} layers failed:\n{done.stderr[-3000:]}")
        got[layers] = json.loads(done.stdout.strip().splitlines()[-1])
        print(layers, got[layers], flush=True)
    a, b = got[2], got[32]
    lines = ["# Where the first step of `adapt()` + `torch.compile(gpt_model)` goes (regions, hidden 128, seq 128, CPU)",
             "",
             "One fresh process per size, caches off; the first training step under cProfile timed by the main "
             "thread's CPU clock (`time.thread_time`: load from other processes on this shared machine does not "
             "stretch it; the profiler's own overhead is in it, heaviest on code made of many small Python calls, such as "
             "the memory ordering's loop, so compare sizes and rows, not absolute seconds). Each phase "
             "is one function's cumulative time; phases nest (the backend runs inside Dynamo's compile, the "
             "partition inside the backend). `python -m bench.compile_time --phases`.", "",
             "| phase | 2 layers: calls | CPU (s) | 32 layers: calls | CPU (s) | 32 - 2 (s) |",
             "|---|---|---|---|---|---|",
             f"| the whole first step | | {a['total']:.2f} | | {b['total']:.2f} | {b['total'] - a['total']:+.2f} |"]
    for phase in PHASES:
        (ca, ta), (cb, tb) = a["phases"].get(phase, (0, 0.0)), b["phases"].get(phase, (0, 0.0))
        lines.append(f"| {phase} | {ca} | {ta:.2f} | {cb} | {tb:.2f} | {tb - ta:+.2f} |")
    lines.append(f"| the second step, unprofiled | | {a['second_step_cpu']:.2f} | | {b['second_step_cpu']:.2f} "
                 f"| {b['second_step_cpu'] - a['second_step_cpu']:+.2f} |")
    (RESULTS / "compile_time_phases.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "compile_time_phases.md").read_text())


# The memory ordering (npu_compile/passes/reorder.py) on each graph the whole model's compile hands it, timed by the
# main thread's CPU clock: the least-peak-first order alone (lpmf_order), then the whole pass (liveness before and
# after, the move) as the backend runs it.
_ORDERING_CHILD = r"""
import json, sys, time
import torch
import megatron_glue
import npu_compile.backend as backend
from megatron_glue.capture import models
from megatron_glue.capture.adaptations import groups_for
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from npu_compile.passes.reorder import lpmf_order
layers, rows, ordering = int(sys.argv[1]), [], backend.reorder_for_peak
def timed(gm, dies_inside):
    t = time.thread_time()
    lpmf_order(gm.graph, dies_inside)
    order_s = time.thread_time() - t
    t = time.thread_time()
    peaks = ordering(gm, dies_inside)
    rows.append({"nodes": len(gm.graph.nodes), "order_s": order_s, "pass_s": time.thread_time() - t, "peaks": peaks})
    return peaks
backend.reorder_for_peak = timed
megatron_glue.adapt(groups_for(one_graph=True)); models.init_single_process()
model = build_gpt_model(gpt_config(hidden_size=128, num_attention_heads=4, num_layers=layers), 128, 128)
torch.compile(model, backend="ascend", options={"cache": False})(**synthetic_batch(2, 128, 128)).mean().backward()
print(json.dumps(rows))
"""


def ordering_main() -> None:
    """bench/results/compile_time_ordering.md: the memory ordering's CPU time on the outer graphs as layers grow."""
    lines = ["# The memory ordering on the whole model's graphs (`adapt()` + `torch.compile(gpt_model)`, regions, "
             "hidden 128, seq 128, CPU)", "",
             "Each graph the backend orders (the region's forward and backward, the outer forward and backward), one "
             "fresh process per size; CPU seconds of the main thread (`time.thread_time`). `order` is the "
             "least-peak-first order alone (`lpmf_order`), `pass` the whole `reorder_for_peak` (the liveness before "
             "and after, the move). Near-linear: the outer graphs' µs per node stays flat as they grow. "
             "`python -m bench.compile_time --ordering`.", "",
             "| layers | graph | nodes | order (s) | µs / node | pass (s) | peak before (MiB) | after (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for layers in (2, 8, 32, 64):
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
            env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache,
                       TORCHINDUCTOR_CACHE_DIR=inductor, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                       TORCHINDUCTOR_AUTOGRAD_CACHE="0", PYTHONWARNINGS="ignore")
            done = subprocess.run([sys.executable, "-c", _ORDERING_CHILD, str(layers)], env=env, capture_output=True,
                                  text=True, timeout=3600, cwd=Path(__file__).parent.parent)
        if done.returncode:
            raise RuntimeError(f"ordering at {layers} layers failed:\n{done.stderr[-3000:]}")
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        print(layers, rows, flush=True)
        # in compile order: each kind's region first (npu_compile/backend.py, _compile_regions), then its outer graph
        names = ["region fw", "outer fw", "region bw", "outer bw"] if len(rows) == 4 else [str(i) for i in rows]
        for name, r in zip(names, rows):
            before, after = r["peaks"]
            lines.append(f"| {layers} | {name} | {r['nodes']} | {r['order_s']:.3f} "
                         f"| {1e6 * r['order_s'] / r['nodes']:.0f} | {r['pass_s']:.3f} | {before / 2**20:.2f} "
                         f"| {after / 2**20:.2f} |")
    (RESULTS / "compile_time_ordering.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "compile_time_ordering.md").read_text())


def run(layers: int, backend: str, cache_dir: str, inductor_dir: str) -> dict:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache_dir,
               TORCHINDUCTOR_CACHE_DIR=inductor_dir, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(layers), backend], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=Path(__file__).parent.parent)
    if done.returncode:
        raise RuntimeError(f"{backend} at {layers} layers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    rows, whole_rows = [], []
    for layers in LAYERS:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as ind, \
                tempfile.TemporaryDirectory() as ind2:
            cold = run(layers, "ascend", cache, ind)
            warm = run(layers, "ascend", cache, ind)  # same cache dir: a restarted job
            if warm["unique_graphs"] or warm["precompile"].get("compiled"):
                raise RuntimeError(f"the warm run at {layers} layers traced again: {warm}")
            inductor = run(layers, "inductor", cache, ind2)
        rows.append((layers, cold, warm, inductor))
        print(layers, cold, warm, inductor, flush=True)
        whole_rows.append((layers, run_whole(layers, "frames"), run_whole(layers, "regions"),
                           run_whole(layers, "inlined"), cold, warm, *run_whole_warm(layers),
                           run_whole(layers, "torch")))
        print(layers, "whole", whole_rows[-1][1:4], whole_rows[-1][6:], flush=True)
    base = rows[0][1]["first_step_s"]
    parts = ("rule_tracing", "rule_matching", "partition", "aten_stages", "lowering", "cache")
    lines = ["# First-step time of a per-layer compiled GPT (hidden 128, seq 128, batch 2, CPU)", "",
             "Each figure from a fresh process; cold = empty caches, warm = a second process on the cache the cold "
             "one wrote: it loads each compile whole (`npu_compile.precompile`: Dynamo's guards, aot_autograd's "
             "wrappers, the lowered graphs) and traces nothing; its second step is the step itself, which a warm "
             "start cannot save (the machine is shared: a loaded run slows the steps more than the compiles). "
             "`python -m bench.compile_time`.", "",
             "| layers | ascend cold (s) | vs 2 layers | ascend warm (s) | warm / cold | warm 2nd step (s) "
             "| inductor cold (s) | graphs |",
             "|---|---|---|---|---|---|---|---|"]
    for layers, cold, warm, ind in rows:
        c, w = cold["first_step_s"], warm["first_step_s"]
        lines.append(f"| {layers} | {c:.2f} | {c / base:.2f}x | {w:.2f} | {w / c:.2f} | {warm['second_step_s']:.2f} "
                     f"| {ind['first_step_s']:.2f} "
                     f"| {cold['unique_graphs']} |")
    lines += ["", "Where the backend's own time goes (report.json `compile_s`, summed over the graphs; the rest of the "
              "first step is Dynamo, aot_autograd and running it):", "",
              "| layers | run | " + " | ".join(parts) + " |", "|---|---|" + "---|" * len(parts)]
    for layers, cold, warm, _ in rows:
        for name, r in (("cold", cold), ("warm", warm)):
            lines.append(f"| {layers} | {name} | " + " | ".join(f"{r['parts'].get(k, 0.0):.2f}" for k in parts) + " |")
    lines += whole_model_lines(whole_rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compile_time.md").write_text("\n".join(lines) + "\n")
    plot(RESULTS / "compile_time.md")
    print((RESULTS / "compile_time.md").read_text())


if __name__ == "__main__":
    if "--phases" in sys.argv[1:]:
        phases_main()
    elif "--ordering" in sys.argv[1:]:
        ordering_main()
    else:
        whole_model_main() if "--whole-model" in sys.argv[1:] else main()

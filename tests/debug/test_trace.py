"""Each stage's graph reaches tlparse (TORCH_TRACE) and TORCH_LOGS="+npu_compile", in a fresh interpreter."""

import os
import re
import subprocess
import sys
import textwrap


def test_stage_graphs_are_structured_trace_artifacts_and_logs(tmp_path):
    code = textwrap.dedent(
        """
        import torch
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU())
        torch.compile(m, backend="ascend")(torch.randn(2, 4)).sum().backward()
        """
    )
    env = {**os.environ, "TORCH_TRACE": str(tmp_path / "trace"), "TORCH_LOGS": "+npu_compile"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (log,) = (tmp_path / "trace").iterdir()
    text = log.read_text()
    for name in ("npu_compile_0_0_dynamo_00_captured", "npu_compile_0_0_joint_00_aot_joint",
                 "npu_compile_0_0_forward_00_aot", "npu_compile_0_0_backward_00_aot"):
        assert f'"name": "{name}"' in text, name
    for kind in ("forward", "backward"):
        assert re.search(rf'"name": "npu_compile_0_0_{kind}_\d\d_lowered_reference"', text), kind
    assert "torch.ops.aten.gelu_backward.default" in text  # the payload is the graph code
    # the module logger at DEBUG: stage graphs (unchanged ones named, not repeated) and the summaries
    assert "graph 0_0 forward after lowered_reference:" in out.stderr
    assert re.search(r"graph 0_0 forward stages \(nodes\): aot \d+ → memory_order \d+", out.stderr)
    assert re.search(r"graph 0_0 \(reference\): forward\+backward compiled, fusions .*, \d+ unfused, peak ", out.stderr)


def test_info_is_one_line_per_graph_and_its_stage_summaries(tmp_path):
    """At INFO a 3-layer model logs a handful of lines per compiled graph, no graph code."""
    code = textwrap.dedent(
        """
        import torch
        layers = [torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                      torch.nn.Linear(256, 64)) for _ in range(3)]
        m = torch.nn.Sequential(*layers)
        torch.compile(m, backend="ascend")(torch.randn(4, 16, 64)).sum().backward()
        """
    )
    run = lambda logs: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                      env={**os.environ, "TORCH_LOGS": logs}, timeout=300)
    info, debug = run("npu_compile"), run("+npu_compile")
    assert info.returncode == 0 and debug.returncode == 0, info.stderr[-3000:] + debug.stderr[-3000:]
    lines = [line for line in info.stderr.splitlines() if "npu_compile" in line or "graph 0_0" in line]
    assert len(lines) <= 8, "\n".join(lines)
    assert "def forward" not in info.stderr
    assert len(debug.stderr) < 400_000, len(debug.stderr)  # the graphs, each once per change
    assert "def forward" in debug.stderr

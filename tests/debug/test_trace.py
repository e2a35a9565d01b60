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
    for name in ("npu_compile_dynamo_00_captured", "npu_compile_joint_00_aot_joint",
                 "npu_compile_forward_00_aot", "npu_compile_backward_00_aot"):
        assert f'"name": "{name}"' in text, name
    for kind in ("forward", "backward"):
        assert re.search(rf'"name": "npu_compile_{kind}_\d\d_lowered_reference"', text), kind
    assert "torch.ops.aten.gelu_backward.default" in text  # the payload is the graph code
    # the module logger at DEBUG: stage graphs and the per-graph summary
    assert "graph 0_0 forward after lowered_reference:" in out.stderr
    assert "graph 0_0 (reference): backward compiled" in out.stderr

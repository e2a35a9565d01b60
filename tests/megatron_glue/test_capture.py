"""One TransformerLayer captured at TP=8 + SP over torch's fake process group, in a fresh process, on meta."""

import pytest
import torch

from megatron_glue.capture.layer import LayerCapture, capture_layer_fake_pg


def _summary(capture: LayerCapture):
    """Runs in the capturing process, where the GraphModules are."""
    values = [n.meta["val"] for gm in (capture.forward, capture.backward) for n in gm.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    forward_inputs = [n.meta["val"] for n in capture.forward.graph.find_nodes(op="placeholder")]
    # The activation input is the one 3-D input ([s, b, h]; params are 1-D/2-D, the mask 4-D); where it sits
    # among the params differs between megatron-core lines.
    return {"devices": sorted({v.device.type for v in values}),
            "activations": [tuple(v.shape) for v in forward_inputs if isinstance(v, torch.Tensor) and v.dim() == 3]}


@pytest.mark.slow
def test_tp8_sp_layer_is_one_graph_with_gathers_and_scatters_each_way():
    capture = capture_layer_fake_pg(tp=8, sp=True, hidden=512, heads=8, seq=1024, dtype=torch.bfloat16,
                                    analyze=_summary, timeout=300)
    assert (capture.dynamo_graphs, capture.graph_breaks) == (1, 0)
    # Per direction: an all-gather before qkv and fc1, a reduce-scatter after proj and fc2 (and their transposes).
    both = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert capture.collectives == {"forward": both, "backward": both}
    assert "_c10d_functional.wait_tensor" in capture.forward_code and "bf16[" in capture.forward_code
    assert capture.analysis == {"devices": ["meta"], "activations": [(1024 // 8, 1, 512)]}  # the rank's SP shard
    assert capture.forward is None  # GraphModules stay in the capturing process

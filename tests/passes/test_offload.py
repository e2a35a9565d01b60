"""Option ``offload`` (passes/offload.py): saved activations of named modules copied to host memory after the
forward and prefetched before the backward. The planner's peak with and without it to the byte, compiled equal to
eager (output and every gradient), the copies' lowering on the npu targets, and the option's check."""

import pytest
import torch
import torch.nn.functional as F

from npu_compile import config
from npu_compile.debug.report import collect
from npu_compile.lowering.npu import graph_modes


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Small(torch.nn.Module):
    """``inner`` saves one activation, tanh's output (32 x 32 fp32, 4096 bytes); the forward's peak comes later,
    outside it: a 16x repeat of x and its double (65536 bytes each), which the backward never needs."""

    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x).sum() + (x.repeat(16, 1) * 2).sum()


def small_memory(options):
    torch.manual_seed(0)
    model, x = Small(), torch.randn(32, 32)
    with collect() as reports:
        torch.compile(model, backend="ascend", options={"cache": False, **options})(x).backward()
    torch._dynamo.reset()
    return reports[0].memory


def test_offloaded_bytes_leave_the_planned_peak_to_the_byte():
    plain, offloaded = small_memory({}), small_memory({"offload": ["inner"]})
    # without: at the forward's double of the repeat, repeat + double + tanh's saved output + the first sum's scalar
    assert plain["lower_bound_bytes"] == 65536 + 65536 + 4096 + 4 == 135172
    assert plain["saved_activation_bytes"] == 4096
    figures = offloaded["offload"]
    assert figures["tensors"] == [{"name": "tanh", "module": "inner", "shape": [32, 32], "dtype": "float32",
                                   "bytes": 4096, "saved_values": ["detach_1"]}]
    assert figures["bytes"] == 4096
    # with: tanh's output leaves the device after its forward use; the backward holds it again only from its prefetch
    assert figures["peak_bytes_without"] == 135172
    assert figures["peak_bytes_with"] == offloaded["lower_bound_bytes"] == offloaded["planned_peak_bytes"] \
        == 135172 - 4096
    assert offloaded["saved_activation_bytes"] == 0  # on the device, between forward and backward
    # each way, 4096 bytes over the profile's host link (31.5 GB/s): 0.13 µs
    assert figures["d2h_us"] == figures["h2d_us"] == round(4096 / 31.5e9 * 1e6, 3) == 0.13
    assert "offload" not in plain


class Attention(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, h))


class Layer(torch.nn.Module):
    """A pre-norm transformer layer named as megatron-core's: input_layernorm, self_attention, pre_mlp_layernorm."""

    def __init__(self, h=64, heads=4):
        super().__init__()
        self.input_layernorm, self.pre_mlp_layernorm = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.self_attention = Attention(h, heads)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.fc2(F.gelu(self.fc1(self.pre_mlp_layernorm(x))))


def run_layer(options=None, compiled=True):
    torch.manual_seed(0)
    model = Layer()
    x = torch.randn(2, 96, 64, requires_grad=True)
    fn = torch.compile(model, backend="ascend", options={"cache": False, **(options or {})}) if compiled else model
    with collect() as reports:
        out = fn(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    torch._dynamo.reset()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())], (reports[0] if reports else None)


@pytest.fixture(scope="module")
def eager():
    return run_layer(compiled=False)[0]


def test_compiled_with_offload_equals_eager_output_and_gradients(eager):
    got, report = run_layer({"offload": ["self_attention"]})
    errors = [(g - e).abs().max().item() for g, e in zip(got, eager)]
    assert max(errors) <= 1e-6, errors
    figures = report.memory["offload"]
    # the attention's saved values: its input (a view read by qkv), the qkv output that q, k, v view (one buffer,
    # copied once), the softmax statistics, the attention output (read by the backward and viewed by proj), proj's
    names = {t["name"]: t["saved_values"] for t in figures["tensors"]}
    assert sorted(names["addmm"]) == ["transpose_int", "transpose_int_1", "transpose_int_2"]
    assert {t["module"] for t in figures["tensors"]} == {"self_attention"}
    assert report.lowered_ops["npu_compile.offload"] == report.lowered_ops["npu_compile.prefetch"] \
        == len(figures["tensors"]) == 6
    assert figures["peak_bytes_with"] < figures["peak_bytes_without"]
    assert report.memory["lower_bound_bytes"] == figures["peak_bytes_with"]


def test_npu_targets_copy_to_pinned_host_memory_and_leave_torchairs_graph_modes(eager, tmp_path):
    got, report = run_layer({"offload": ["self_attention"], "target": "npu-sim", "dump_dir": str(tmp_path)})
    errors = [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, eager)]
    assert max(errors) <= 1e-5, errors
    assert "npu_compile.offload" not in report.lowered_ops and "npu_compile.prefetch" not in report.lowered_ops
    forward = next((tmp_path / report.graph_id / "forward").glob("*_lowered_npu-sim.py")).read_text()
    backward = next((tmp_path / report.graph_id / "backward").glob("*_lowered_npu-sim.py")).read_text()
    assert forward.count("device = device(type='cpu'), pin_memory = True, non_blocking = True") == 6
    assert backward.count("device = device(type='cpu'), non_blocking = True") == 6
    for kind in ("forward", "backward"):
        mode = report.graph_modes[kind]
        assert mode["graph_mode"] == "eager", mode
        assert f"aten._to_copy: graph_mode 'ge' -> 'aclgraph': {graph_modes.HOST_COPY_GE}" in mode["demoted"]
        assert f"aten._to_copy: graph_mode 'aclgraph' -> 'eager': {graph_modes.HOST_COPY_CAPTURE}" \
            in mode["demoted"]
    # the planner still sees the host copies as host memory after lowering
    assert report.memory["saved_activation_bytes"] < run_layer({"target": "npu-sim"})[1].memory[
        "saved_activation_bytes"]


def test_the_option_takes_module_names():
    assert config.validate({"offload": ["self_attention", "self_attention"]}).offload == ("self_attention",)
    with pytest.raises(config.OptionError) as info:
        config.validate({"offload": "self_attention"})
    assert str(info.value) == ("npu_compile option 'offload' got 'self_attention'; it takes a list of module attribute "
                               "names (e.g. [\"self_attention\"]) whose saved activations go to host memory")


def _backward_like():
    """A backward-shaped graph: six sines (each a memory-bound pass over 1 MiB) before the read of a prefetch."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from npu_compile.passes import offload

    def backward(host, a):
        back = torch.ops.npu_compile.prefetch(host, torch.device("cpu"))
        for _ in range(6):
            a = torch.sin(a)
        return a + back

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(256, 1024), torch.randn(256, 1024))
    return gm, offload


def _order(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_a_prefetch_is_issued_as_far_ahead_as_its_copy_takes():
    from npu_compile.device import profile

    gm, offload = _backward_like()
    nbytes = 256 * 1024 * 4
    sin_us = 2 * nbytes / profile.ASCEND_910B.hbm_bytes_per_s * 1e6  # reads and writes 1 MiB
    # a link on which the copy takes 2.5 sines: issued three sines before its reader (the fewest that cover it)
    fast = profile.load({"host_link_bytes_per_s": nbytes / (2.5 * sin_us) * 1e6})
    assert offload.place_prefetches(gm, fast) == 1
    assert _order(gm) == ["sin", "sin_1", "sin_2", "prefetch", "sin_3", "sin_4", "sin_5", "add"]
    assert offload.exposed_h2d_us(gm, fast) == 0.0
    # on the 910B profile's link the copy takes 25.4 sines: from the graph's start, and the reader waits the rest
    assert offload.place_prefetches(gm) == 1
    assert _order(gm)[0] == "prefetch"
    copy_us = nbytes / profile.ASCEND_910B.host_link_bytes_per_s * 1e6
    assert offload.exposed_h2d_us(gm) == pytest.approx(copy_us - 6 * sin_us, abs=1e-3)


def test_auto_budget_fits_by_offloading_instead_of_recomputing(eager):
    """memory_budget "auto" plans each budget with the offload applied: under a cap of 1,000,000 bytes the layer
    fits at budget 1.0 (nothing recomputed) once self-attention's activations go to the host, where alone it needs
    budget 0.5 (on the reference target, which saves the GeLU's output at 1.0; the npu targets' 1.0 recomputes it)."""
    cap = {"memory_budget": "auto", "device_memory": 1_000_000}
    _, alone = run_layer(cap)
    got, offloaded = run_layer({**cap, "offload": ["self_attention"]})
    assert [(p["budget"], p["planned_peak_bytes"]) for p in alone.budget["tried"]] == [
        (1.0, 1154816), (0.8, 1104128), (0.6, 1054976), (0.5, 956672)]
    assert [(p["budget"], p["planned_peak_bytes"]) for p in offloaded.budget["tried"]] == [(1.0, 952064)]
    assert offloaded.memory["recompute_nodes"] < alone.memory["recompute_nodes"]
    assert max((g - e).abs().max().item() for g, e in zip(got, eager)) <= 1e-6

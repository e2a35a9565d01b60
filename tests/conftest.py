"""Shared test set-up: a fresh Dynamo for every test (graph ids, so dump dirs, start at 0_0), torch's and Python's
RNG seeded from the test's id, Hypothesis profiles, and the `fuzz` switch.

Profiles: "default" (no deadline: an example may compile; derandomized — each test draws the same examples on
every run and no example database is read, so `make test` is never red by chance) and "fuzz" (random, many more
examples, the database kept so that a failure replays), chosen by `HYPOTHESIS_PROFILE`. A failure `make fuzz`
finds becomes an explicit `@example` of the property it broke. Property tests state their own example counts for the default run; `fuzz`-marked twins take
theirs from the fuzz profile and run only when asked for (`make fuzz`, `-m fuzz` or `HYPOTHESIS_PROFILE=fuzz`).
"""

import os
import random
import sys
import tempfile
import zlib

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# The persistent compile cache of this session's jobs (subprocesses included) starts empty, away from the user's.
os.environ.setdefault("NPU_COMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="npu_compile_cache_"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import xdist_order  # noqa: E402  (tests/, on sys.path as this conftest's folder)

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("default", deadline=None, suppress_health_check=_SLOW_OK, derandomize=True, database=None,
                          print_blob=True)
settings.register_profile("fuzz", deadline=None, suppress_health_check=_SLOW_OK, max_examples=2000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help="merge each test's seconds into tests/durations.json (the xdist order: tests/xdist_order.py)")


def pytest_configure(config):
    if config.getoption("store_durations"):
        config.pluginmanager.register(xdist_order.DurationRecorder(), "store-durations")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope`, longest modules first (tests/xdist_order.py)."""
    return xdist_order.make_scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    if "fuzz" in (config.getoption("markexpr") or "") or os.environ.get("HYPOTHESIS_PROFILE") == "fuzz":
        return
    skip = pytest.mark.skip(reason="long fuzz run: select with -m fuzz or HYPOTHESIS_PROFILE=fuzz")
    for item in items:
        if item.get_closest_marker("fuzz"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    # Each test's random inputs depend on the test alone, not on which tests ran before it (-k, -x, order).
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    torch._dynamo.reset()
    # In-process compiles run every pass (tests look at their stages): the cache only where a test asks for it.
    from npu_compile import config

    with config.patch(cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def moe_settings_restored():
    """Process-wide settings a test may set as the job does (training.moe_dynamo_config) come back after it, and
    megatron-core's MoE aux-loss tracker is emptied (own fixture: tests/megatron_glue overrides fresh_dynamo)."""
    dynamo, compiler = torch._dynamo.config, torch.compiler.config
    kept = (dynamo.capture_scalar_outputs, dynamo.capture_dynamic_output_shape_ops, compiler.dynamic_sources)
    yield
    dynamo.capture_scalar_outputs, dynamo.capture_dynamic_output_shape_ops, compiler.dynamic_sources = kept
    _empty_moe_tracker()


def _empty_moe_tracker() -> None:
    """megatron-core's MoE aux-loss tracker is process-wide and each entry keeps the layer count of the model that
    made it (a later model with more layers indexes past it): emptied after each test that imported MoE."""
    utils, state = sys.modules.get("megatron.core.transformer.moe.moe_utils"), sys.modules.get(
        "megatron.core.parallel_state")
    get = getattr(utils, "get_moe_layer_wise_logging_tracker", None) or getattr(
        state, "get_moe_layer_wise_logging_tracker", None)
    if get is not None:
        get().clear()

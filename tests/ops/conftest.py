"""Hypothesis profiles for the op tests, and the `fuzz` switch.

Profiles: "default" (no deadline: the first example pays for op registration and tracing) and "fuzz" (many
more examples). `HYPOTHESIS_PROFILE=fuzz` loads the fuzz profile. Property tests state their own example
counts for the default run; each family also has `fuzz`-marked twins that take their counts from the fuzz
profile and run only when asked for: `pytest tests/ops -m fuzz` or `HYPOTHESIS_PROFILE=fuzz`.
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("default", deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile("fuzz", deadline=None, suppress_health_check=_SLOW_OK, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    asked = "fuzz" in (config.getoption("markexpr") or "") or os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
    if asked:
        return
    skip = pytest.mark.skip(reason="long fuzz run: select with -m fuzz or HYPOTHESIS_PROFILE=fuzz")
    for item in items:
        if item.get_closest_marker("fuzz") and _HERE in Path(str(item.path)).parents:
            item.add_marker(skip)

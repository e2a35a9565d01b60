"""Which megatron-core line is installed, and what the job must say differently to each.

The job runs on 0.16.1 and on the 0.12.1 line. Where their APIs differ, the difference lives here, named, so
that the job's code reads the same on both.
"""

from __future__ import annotations

import functools
from importlib.metadata import version

from packaging.version import Version


@functools.lru_cache(maxsize=None)
def megatron_core() -> Version:
    return Version(version("megatron-core"))


def at_least(release: str) -> bool:
    return megatron_core() >= Version(release)


def transformer_config_extras() -> dict:
    """TransformerConfig fields that exist only on some lines."""
    from megatron.core.transformer import TransformerConfig

    extras = {}
    if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__:  # 0.14 on
        extras["cuda_graph_scope"] = []  # the default "full" earns a deprecation warning (transformer_config.py)
    return extras

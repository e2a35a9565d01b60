"""What makes megatron-core capturable by torch.compile and runnable off CUDA (CPU for tests, Ascend NPU for real).

One line for users, at any tensor-parallel size, with or without sequence parallelism, before or after the
process group and Megatron's parallel state are set up:

    import megatron_glue; megatron_glue.adapt()          # the groups `adaptations.groups_for()` names

`distributed.init_distributed` and the training job (`megatron_glue.training.device.init`) apply the same groups.

`adaptations` holds the one registry of every change we make to Megatron, with its reason, keyed by megatron-core
version where the lines differ (tested on 0.12.1 and 0.16.1; `registry.skipped()` lists those not for the installed
one), and the groups of the model's layers; `training_adaptations` adds group "training" (megatron-core's optimizer,
schedules and checkpoint code off CUDA) to the same registry; `models` builds small GPT/Llama-style models and
batches; `distributed` sets up TP workers, watches the job's ranks, launches workers for tests and does the TP grad
work Megatron's DDP would; `layer` captures one layer at TP=8 over a fake process group for benchmarks; `testing`
holds pytest fixtures shared by test folders.

This room imports nothing of megatron_glue's other rooms (tests/megatron_glue/test_glue_layering.py).
"""

import contextlib
import warnings

from megatron_glue.capture.adaptations import registry
from megatron_glue.capture import training_adaptations  # noqa: F401  (registers the "training" group)


# What megatron-core 0.16.1 or 0.12.1 (and torch under it) says on import or model build that does not apply
# here: we use neither TE nor Apex, and the deprecations are Megatron's own business.
_MEGATRON_NOISE = (
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed"),
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),
    (DeprecationWarning, r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'"),
    (DeprecationWarning, r"The following imports from `dynamic_context\.py`"),
    (DeprecationWarning, r"MLP requires ffn_hidden_size"),
)


@contextlib.contextmanager
def quiet_megatron():
    """Silence _MEGATRON_NOISE, and nothing else, inside the block."""
    with warnings.catch_warnings():
        for category, message in _MEGATRON_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def adapt(groups=None) -> dict:
    """Apply the named groups of adaptations (idempotent); returns what is applied, name -> reason.

    groups None: what this machine needs for megatron-core at any parallel layout (`adaptations.groups_for()`:
    "cpu" off CUDA/NPU, "compile", "tp_compile", "sp")."""
    from megatron_glue.capture.adaptations import groups_for

    if groups is None:
        groups = groups_for()
    with quiet_megatron():  # applying imports the Megatron modules it changes
        registry.apply_groups(groups)
    return registry.applied()

"""Makes megatron-core capturable by torch.compile and runnable off CUDA (CPU for tests, Ascend NPU for real).

One line for users:

    import megatron_glue; megatron_glue.adapt()          # groups "cpu" and "compile"

`adaptations` holds every change we make to Megatron, with its reason; `models` builds small GPT/Llama-style
models and batches on one process; `testing` holds fixtures shared by test folders.
"""

from megatron_glue.adaptations import registry


def adapt(groups=("cpu", "compile")) -> dict:
    """Apply the named groups of adaptations (idempotent); returns what is applied, name -> reason."""
    registry.apply_groups(groups)
    return registry.applied()

from megatron_glue.testing import megatron_cpu  # noqa: F401

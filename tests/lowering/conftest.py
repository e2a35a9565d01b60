from megatron_glue.capture.testing import megatron_cpu  # noqa: F401

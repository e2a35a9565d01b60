from megatron_glue.testing import fresh_dynamo, megatron_cpu  # noqa: F401

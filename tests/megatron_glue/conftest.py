import pytest

from megatron_glue.capture.testing import fresh_dynamo, megatron_cpu  # noqa: F401


@pytest.fixture(scope="module")
def process_state_kept():
    """For the converter's test modules (`pytest.mark.usefixtures`): conversions in this process and
    hf_models.megatron_logits apply adaptations and set up or tear down the process group; after the module,
    everything is as before (hf_models.process_state_kept)."""
    import hf_models

    with hf_models.process_state_kept():
        yield

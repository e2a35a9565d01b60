"""Megatron on Ascend NPUs (and on CPU for tests), its transformer layers compiled with `backend="ascend"`.

    torchrun ... -m megatron_glue.pretrain_gpt <Megatron-LM's pretrain_gpt.py flags>    the training job
    import megatron_glue; megatron_glue.adapt()      megatron-core made capturable, for a loop of your own
    megatron_glue.compile_layers(gpt_model)          its layers compiled as the job compiles them (warm start)

Its rooms, each a subpackage that a newcomer finds by name (which may import which:
tests/megatron_glue/test_glue_layering.py):

    capture/     what makes megatron-core capturable and runnable off CUDA: the one adaptation registry and its
                 groups, multi-process set-up and the rank watchdog, small models, one-layer capture, test fixtures
    data/        the job's data: tokenizers, megatron-core datasets and the loader, `npu-compile preprocess`,
                 the demo corpus
    training/    the training job: its one argument surface, the GPT pieces, the loop, checkpoints, the device,
                 logs, what differs between megatron-core lines
    convert/     `npu-compile convert`: HuggingFace <-> Megatron checkpoints of the job's model

and its doors, the modules run with `-m`: `pretrain_gpt` (the job) and `demo` (`make demo`). `adaptations` and
`distributed` here are the paths the README documents for `capture.adaptations` and `capture.distributed`.
"""

from megatron_glue.capture import adapt, quiet_megatron


def compile_layers(model, options: dict | None = None):
    """megatron_glue.training.training.compile_layers: a GPTModel's layers, embedding and output layer compiled in
    place as the training job compiles them, starting warm in a second process."""
    from megatron_glue.training.training import compile_layers as compile_

    return compile_(model, options)


__all__ = ["adapt", "compile_layers", "quiet_megatron"]

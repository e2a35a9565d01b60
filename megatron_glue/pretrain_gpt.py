"""GPT pretraining, Megatron-LM's `pretrain_gpt.py` on megatron-core, every transformer layer compiled with
`torch.compile(backend="ascend")`:

    torchrun --nproc_per_node=8 -m megatron_glue.pretrain_gpt <Megatron-LM's pretrain_gpt.py flags>

The door users run with one word changed; the GPT pieces are `megatron_glue.training.gpt` (the model provider,
the batch, the loss, the datasets) and the job around them `megatron_glue.training.training.pretrain`.
"""

import sys

from megatron_glue.training import gpt


def main(argv: list[str] | None = None) -> int:
    """The job, with MindSpeed-LLM's --enable-hf2mg-convert step (the converter's room) before it starts."""
    from megatron_glue.convert.at_start import before_start, refusal
    from megatron_glue.training.sft import pretrain_refusal

    return gpt.main(argv, before_start=before_start, refusals=(refusal, pretrain_refusal))


if __name__ == "__main__":
    sys.exit(main())

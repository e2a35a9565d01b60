"""GPT pretraining, Megatron-LM's `pretrain_gpt.py` on megatron-core, every transformer layer compiled with
`torch.compile(backend="ascend")`:

    torchrun --nproc_per_node=8 -m megatron_glue.pretrain_gpt <Megatron-LM's pretrain_gpt.py flags>

The door users run with one word changed; the GPT pieces are `megatron_glue.training.gpt` (the model provider,
the batch, the loss, the datasets) and the job around them `megatron_glue.training.training.pretrain`.
"""

import sys

from megatron_glue.training.gpt import main

if __name__ == "__main__":
    sys.exit(main())

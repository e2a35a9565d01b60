"""Instruction tuning, MindSpeed-LLM's `posttrain_gpt.py --stage sft --is-instruction-dataset` on megatron-core,
every transformer layer compiled with `torch.compile(backend="ascend")`:

    torchrun --nproc_per_node=8 -m megatron_glue.posttrain_gpt <MindSpeed-LLM's tune_*.sh flags>

The data is what `npu-compile preprocess --handler-name AlpacaStyleInstructionHandler --prompt-type NAME` writes;
samples are padded to --seq-length (or, --no-pad-to-seq-lengths, to their micro-batch's longest), packed rows read
with --reset-attention-mask [--neat-pack] attend within each sample, and the loss counts the answer tokens only
(megatron_glue.training.sft, docs/instruction_tuning.md). The model, the loss and the job are pretrain_gpt's.
"""

import sys

from megatron_glue.training import gpt, sft


def main(argv: list[str] | None = None) -> int:
    from megatron_glue.convert.at_start import before_start, refusal

    def start(args):
        before_start(args)
        sft.before_start(args)

    # the instruction datasets batch their samples themselves (sft.collate: padding, documents)
    return gpt.main(argv, before_start=start, refusals=(refusal, sft.posttrain_refusal),
                    datasets=sft.datasets_provider, name="posttrain_gpt", loader=lambda args, build: build)


if __name__ == "__main__":
    sys.exit(main())

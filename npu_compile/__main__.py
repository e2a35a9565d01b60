"""``python -m npu_compile <command>`` (also the ``npu-compile`` console script)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": "train a small megatron-core GPT eagerly and with backend='ascend', and compare",
    "preprocess": "tokenize a jsonl/json/parquet corpus into megatron-core's .bin/.idx (Megatron-LM's and "
                  "MindSpeed-LLM's preprocess_data.py)",
    "convert": "HuggingFace <-> Megatron checkpoints (MindSpeed-LLM's convert_ckpt_v2.py flags), TP/PP, streamed",
    "doctor": "what is installed (Python, torch, torch_npu, CANN, megatron-core, devices, HCCL) and whether it fits",
}
# Where each command's main(argv) lives; imported only when run, so `import npu_compile` never imports Megatron.
_ENTRY = {"demo": "npu_compile.demo", "preprocess": "megatron_glue.data.preprocess",
          "convert": "megatron_glue.convert", "doctor": "megatron_glue.training.doctor"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: npu-compile <command> [options]\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:10s} {what}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return importlib.import_module(_ENTRY[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

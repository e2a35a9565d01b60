"""``python -m npu_compile <command>`` (also the ``npu-compile`` console script)."""

from __future__ import annotations

import sys

COMMANDS = {"demo": "train a small megatron-core GPT eagerly and with backend='ascend', and compare"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: npu-compile <command> [options]\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:8s} {what}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    from npu_compile import demo

    return demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

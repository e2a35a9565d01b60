"""The training job, as Megatron-LM's `megatron/training/` holds it: `arguments` (the job's one argument surface,
Megatron-LM's flags), `gpt` (the GPT pieces of `pretrain_gpt.py`: model provider, batch, loss, datasets, `main`),
`training` (`pretrain()`: parallel state, model, optimizer, schedules, evaluation), `checkpointing` (Megatron-LM's
layout), `device` (where the job runs), `log` (Megatron-LM's log lines, metrics), `versions` (what the job says
differently to each megatron-core line). The door is `megatron_glue.pretrain_gpt`.

It imports `megatron_glue.capture` and `megatron_glue.data`, never `convert`
(tests/megatron_glue/test_glue_layering.py).
Nothing is imported here, so that parsing the command line (`--help`) does not import Megatron.
"""

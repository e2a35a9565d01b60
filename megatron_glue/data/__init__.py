"""The training job's data: `tokenizer` (Megatron-LM's tokenizers, offline), `datasets` (megatron-core's GPT
datasets and a Megatron-LM-style pretraining loader), `preprocess` (`npu-compile preprocess`: jsonl -> .bin/.idx),
`demo_data` (the demo's corpus, tokenizer and dataset, made from this project's own text).

It imports `megatron_glue.capture` only, never the job or the converter (tests/megatron_glue/test_glue_layering.py).
"""

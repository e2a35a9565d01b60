"""The training job on a checkpoint converted from HuggingFace, as a user runs it: a random-init Llama-3-style model
saved with a BPE tokenizer trained here, its corpus tokenized by `npu-compile preprocess`, converted by
`npu-compile convert`, then evaluated and fine-tuned by `megatron_glue.pretrain_gpt --load MG --finetune`.

The job's losses equal transformers' on the very samples the job read (taken from the job's own datasets and
loader with the job's own arguments), reduced as Megatron reduces them: the sum of the masked token losses over
the token count. Megatron's loss runs over the padded vocabulary, whose padding rows are zero (logit 0), so the
two agree only where nothing is padded: the tokenizer has 4 x 128 tokens. Architecture flags or a vocabulary
that differ from the checkpoint's are refused, naming both values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_models
from pretrain_runs import env, pretrain

FAMILY = "llama3"    # GQA (2 key/value heads), rope θ 500000 with llama3 scaling, untied output layer
VOCAB = 512          # a multiple of 128 x TP for TP 1 and 2: Megatron pads no rows
DOCUMENTS = 200      # of the project's own text (demo_data's corpus)
MBS, GBS = 2, 4      # two micro-batches per global batch
EVAL_ITERS = 2
EOD = "<|endoftext|>"


# -- the HF side: a tokenizer, a model, a corpus ---------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int, folder: Path):
    """A byte-level BPE trained on `texts`, as a transformers PreTrainedTokenizerFast saved into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOD)
    assert len(tokenizer) == vocab_size, f"the corpus gave {len(tokenizer)} tokens, not {vocab_size}"
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="module")
def texts() -> list[str]:
    from megatron_glue.data.demo_data import corpus_documents

    docs = corpus_documents()[:DOCUMENTS]
    assert len(docs) == DOCUMENTS
    return [d["text"] for d in docs]


@pytest.fixture(scope="module")
def hf_dir(texts, tmp_path_factory) -> Path:
    """The HF folder: config.json + model.safetensors (random init) and the tokenizer, vocab_size = its length."""
    folder = tmp_path_factory.mktemp("hf")
    tokenizer = train_tokenizer(texts, VOCAB, folder)
    hf_models.save_random_hf(FAMILY, str(folder), vocab_size=len(tokenizer))
    return folder


@pytest.fixture(scope="module")
def other_tokenizers(texts, tmp_path_factory) -> dict[int, Path]:
    """Tokenizers of 500 and 600 tokens, trained on the same text: a vocabulary smaller and larger than the model's."""
    out = {}
    for size in (500, 600):
        out[size] = tmp_path_factory.mktemp(f"tokenizer{size}")
        train_tokenizer(texts, size, out[size])
    return out


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory) -> Path:
    """`npu-compile convert` hf -> mg of hf_dir (TP=PP=1 targets: a torch_dist checkpoint loads at any layout)."""
    mg = tmp_path_factory.mktemp("mg")
    done = subprocess.run([sys.executable, "-m", "npu_compile", "convert", "--load-model-type", "hf",
                           "--save-model-type", "mg", "--load-dir", str(hf_dir), "--save-dir", str(mg)],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (mg / "latest_checkpointed_iteration.txt").read_text() == "release"
    return mg


@pytest.fixture(scope="module")
def data_prefix(hf_dir, texts, tmp_path_factory) -> str:
    """The corpus tokenized by `npu-compile preprocess` with the HF tokenizer (--append-eod)."""
    from npu_compile.__main__ import main

    folder = tmp_path_factory.mktemp("data")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    rc = main(["preprocess", "--input", str(corpus), "--output-prefix", str(folder / "corpus"), "--tokenizer-type",
               "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir), "--append-eod"])
    assert rc == 0
    return str(folder / "corpus_text_document")


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


# -- the job's flags, its arguments and its samples ------------------------------------------------------------

def model_flags(mg: Path) -> list[str]:
    return (mg / "model_flags.txt").read_text().split()


def tokenizer_flags(tokenizer_dir: Path) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir)]


def job_flags(mg: Path, hf_dir: Path, data_prefix: str, cache: Path, *more: str) -> list[str]:
    """Everything a run needs: the converted checkpoint's architecture flags, the HF tokenizer, the data, fp32,
    no dropout, every step logged."""
    return [*model_flags(mg), "--load", str(mg), "--finetune", *tokenizer_flags(hf_dir), "--data-path",
            data_prefix, "--data-cache-path", str(cache), "--split", "90,5,5", "--seq-length", "32",
            "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--distributed-backend", "gloo", "--log-interval", "1", "--no-progress-bar",
            *more]


def job_args(flags: list[str], world_size: int = 1):
    """pretrain_gpt's args for `flags`, with the tokenizer and vocabulary set as its main sets them."""
    from megatron_glue.training import gpt
    from megatron_glue.training.arguments import parse_args

    args = parse_args(flags, world_size=world_size)
    gpt.set_vocabulary(args)
    return args


def job_batches(args, split: int, global_batches: int) -> list[dict]:
    """The micro-batches the job reads first from split 0 (train), 1 (validation) or 2 (test): its own
    datasets_provider and loader at data-parallel size 1, from sample 0 (--finetune starts there)."""
    from megatron_glue.training import gpt
    from megatron_glue.data.datasets import build_loader

    assert args.data_parallel_size == 1
    dataset = gpt.datasets_provider(args)[split]
    loader = build_loader(dataset, consumed_samples=0, micro_batch_size=args.micro_batch_size,
                          data_parallel_rank=0, data_parallel_size=1)
    return [next(loader) for _ in range(global_batches * args.num_microbatches)]


def hf_loss(model, batches: list[dict], padded_vocab: int | None = None) -> float:
    """transformers' loss on `batches`, reduced as Megatron reduces: sum of the masked token losses / token
    count. `padded_vocab`: with the zero logits of Megatron's padding rows appended, as the job computes it."""
    total = count = 0.0
    for batch in batches:
        with torch.no_grad():
            logits = model(batch["tokens"]).logits.float()
        if padded_vocab is not None:
            logits = torch.cat([logits, logits.new_zeros(*logits.shape[:-1], padded_vocab - logits.shape[-1])], -1)
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        mask = batch["loss_mask"].flatten().float()
        total += float((losses.double() * mask).sum())
        count += float(mask.sum())
    return total / count


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _evaluate(tmp_path, converted, hf_dir, data_prefix, cache, *more, nproc=1):
    """pretrain_gpt --skip-train --train-iters 0: load, evaluate (validation and test), exit."""
    flags = job_flags(converted, hf_dir, data_prefix, cache, "--skip-train", "--train-iters", "0", "--eval-iters",
                      str(EVAL_ITERS), *more)
    run = pretrain(tmp_path, *flags, nproc=nproc, base=[]).check()
    return flags, run, {kind: run.rows(kind)[0]["lm loss"] for kind in ("validation", "test")}


# -- evaluation equals transformers ----------------------------------------------------------------------------

@pytest.mark.training
# TP=2 and the fine-tune on 0.16.1 only: the 0.12.1 line's loading at TP=2 is test_convert.py's, its compiled
# training test_pretrain_*'s
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.any_megatron_line)])
def test_evaluation_equals_transformers(tp, converted, hf_dir, data_prefix, cache, hf_model, tmp_path):
    flags, run, job = _evaluate(tmp_path, converted, hf_dir, data_prefix, cache,
                                "--tensor-model-parallel-size", str(tp), nproc=tp)
    assert f"successfully loaded checkpoint from {converted} [ t 1/{tp}, p 1/1 ] at iteration 0" in run.output
    args = job_args(flags, world_size=tp)
    assert (args.orig_vocab_size, args.padded_vocab_size) == (VOCAB, VOCAB)  # nothing padded
    for split, kind in ((1, "validation"), (2, "test")):
        want = hf_loss(hf_model, job_batches(args, split, EVAL_ITERS))
        print(f"TP={tp} {kind}: job {job[kind]:.7f}, transformers {want:.7f}, "
              f"relative {relative(job[kind], want):.1e}")
        assert relative(job[kind], want) <= 1e-5, (kind, job[kind], want)


OTHERS = ("llama2", "mistral", "qwen2", "qwen2.5", "gpt2")  # with llama3 above: every family
# vocabulary 512, as the tokenizer's: a GPT-2 written by TensorFlow (tf/) and the same weights as a transformers
# folder (hf/, made by transformers' own TF loader); the gpt2 case below is that folder (test_convert_tf.py)
TF_GPT2 = Path(__file__).parent / "fixtures" / "tf_gpt2"


@pytest.fixture(scope="module")
def other_families(hf_dir, tmp_path_factory) -> dict:
    """The other families at the tokenizer's vocabulary, converted here: name -> (mg folder, transformers model).
    GPT-2 is fixtures/tf_gpt2/hf; "gpt2-tf" its TensorFlow original, converted with --load-model-type tf."""
    from transformers import GPT2LMHeadModel

    from megatron_glue.convert import core

    out = {}
    with hf_models.process_state_kept():
        for i, name in enumerate(OTHERS):
            folder = tmp_path_factory.mktemp(name.replace(".", "_"))
            if name == "gpt2":
                model = GPT2LMHeadModel.from_pretrained(TF_GPT2 / "hf", dtype=torch.float32).eval()
                core.hf_to_mg(str(TF_GPT2 / "hf"), str(folder / "mg"), name)
            else:
                model = hf_models.save_random_hf(name, str(folder / "hf"), seed=10 + i, vocab_size=VOCAB)
                core.hf_to_mg(str(folder / "hf"), str(folder / "mg"), name)
            out[name] = (folder / "mg", model)
        folder = tmp_path_factory.mktemp("gpt2_tf")
        core.hf_to_mg(str(TF_GPT2 / "tf"), str(folder / "mg"), source="tf")
        out["gpt2-tf"] = (folder / "mg", out["gpt2"][1])
    return out


@pytest.fixture(scope="module")
def evaluations() -> dict:
    """The job's evaluations of other_families, by name, each run once for the tests that read it."""
    return {}


def _evaluate_family(name, other_families, evaluations, hf_dir, data_prefix, cache, tmp_path):
    if name not in evaluations:
        evaluations[name] = _evaluate(tmp_path, other_families[name][0], hf_dir, data_prefix, cache,
                                      "--no-npu-compile")
    return evaluations[name]


@pytest.mark.training
@pytest.mark.any_megatron_line  # the families' loading on 0.12.1 is test_convert.py's; this is the job's reduction
@pytest.mark.parametrize("name", OTHERS)
def test_every_family_evaluates_to_transformers_loss(name, other_families, evaluations, hf_dir, data_prefix, cache,
                                                     tmp_path):
    """Each family through pretrain_gpt --load --finetune --skip-train (eager: the compiled evaluation is
    llama3's above): the validation lm loss is transformers' on the same samples."""
    model = other_families[name][1]
    flags, _, job = _evaluate_family(name, other_families, evaluations, hf_dir, data_prefix, cache, tmp_path)
    want = hf_loss(model, job_batches(job_args(flags), 1, EVAL_ITERS))
    print(f"{name}: job {job['validation']:.7f}, transformers {want:.7f}, "
          f"relative {relative(job['validation'], want):.1e}")
    assert relative(job["validation"], want) <= 1e-5


@pytest.mark.training
@pytest.mark.any_megatron_line
def test_evaluation_over_a_padded_vocabulary(converted, hf_dir, data_prefix, cache, hf_model, tmp_path):
    """--make-vocab-size-divisible-by 100: 512 tokens get 600 rows, 88 of them zero (megatron-core loads the
    checkpoint's 512 into them). Their logits, 0, join the softmax: the job's loss is higher than transformers',
    and equals it computed with 88 zero logits appended."""
    flags, _, job = _evaluate(tmp_path, converted, hf_dir, data_prefix, cache, "--make-vocab-size-divisible-by",
                              "100")
    args = job_args(flags)
    assert (args.orig_vocab_size, args.padded_vocab_size) == (VOCAB, 600)
    batches = job_batches(args, 1, EVAL_ITERS)
    plain, padded = hf_loss(hf_model, batches), hf_loss(hf_model, batches, padded_vocab=600)
    print(f"padded to 600: job {job['validation']:.7f}, transformers {plain:.7f} (+{job['validation'] - plain:.4f}), "
          f"transformers with 88 zero logits {padded:.7f}")
    assert relative(job["validation"], padded) <= 1e-5
    assert job["validation"] - plain > 0.05  # measured +0.145


@pytest.mark.training
@pytest.mark.any_megatron_line
def test_a_tensorflow_gpt2_evaluates_to_its_hf_conversion_loss(other_families, evaluations, hf_dir, data_prefix,
                                                               cache, tmp_path):
    """The job evaluates the TensorFlow checkpoint's conversion (--load-model-type tf) to the validation and test
    losses of its HF conversion (the gpt2 case above: one launch shared), within 1e-6, and to transformers'."""
    losses = {}
    for name in ("gpt2-tf", "gpt2"):
        flags, _, losses[name] = _evaluate_family(name, other_families, evaluations, hf_dir, data_prefix, cache,
                                                  tmp_path / name)
    want = hf_loss(other_families["gpt2"][1], job_batches(job_args(flags), 1, EVAL_ITERS))
    print(f"TF GPT-2: job {losses['gpt2-tf']}, its HF conversion {losses['gpt2']}, transformers (validation) "
          f"{want:.7f}")
    for kind in ("validation", "test"):
        assert relative(losses["gpt2-tf"][kind], losses["gpt2"][kind]) <= 1e-6, kind
    assert relative(losses["gpt2-tf"]["validation"], want) <= 1e-6


# -- fine-tuning -----------------------------------------------------------------------------------------------

@pytest.mark.training
@pytest.mark.any_megatron_line
def test_finetune_compiled_from_the_converted_checkpoint(converted, hf_dir, data_prefix, cache, hf_model, tmp_path,
                                                        monkeypatch):
    """20 iterations, every layer compiled (the default): the first step's loss is transformers' on the first
    global batch (the weights are the converted ones until that step's update), and the loss falls. The job
    leaves --kv-channels at its default (the head size model_flags.txt gives), saves, and its checkpoint converts
    back to HF with the original config.json: transformers' loss of that model is the job's last validation loss."""
    from transformers import AutoModelForCausalLM

    from megatron_glue.convert import main as convert

    # A compile cache of its own, empty: the training graphs are traced here (from the session's cache, loaded
    # where an earlier test compiled the same shapes, Dynamo would count none of them, only the evaluation's)
    compile_cache = tmp_path / "compile_cache"
    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(compile_cache))
    ckpt = tmp_path / "ckpt"
    flags = job_flags(converted, hf_dir, data_prefix, cache, "--train-iters", "20", "--lr", "1e-3",
                      "--lr-decay-style", "constant", "--eval-iters", "1", "--save", str(ckpt))
    flags = _without(flags, "--kv-channels")
    run = pretrain(tmp_path, *flags, base=[]).check()
    losses = run.losses
    assert len(losses) == 20
    # compiled: Dynamo captured graphs, and the training modules' compiles were stored for a restart
    # (npu_compile.precompile; the evaluation's no-grad graphs are not)
    assert run.rows("end")[0]["graphs"] > 0
    assert list((compile_cache / "precompiled").rglob("*.bin")), sorted(compile_cache.rglob("*"))
    args = job_args(flags)
    want = hf_loss(hf_model, job_batches(args, 0, 1))
    print(f"fine-tune: first {losses[0]:.6f} (transformers {want:.6f}, relative "
          f"{relative(losses[0], want):.1e}); losses {', '.join(f'{x:.3f}' for x in losses)}")
    assert relative(losses[0], want) <= 1e-4
    assert losses[-1] < losses[0]

    back = tmp_path / "hf_back"
    with hf_models.process_state_kept():
        assert convert(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(ckpt),
                        "--save-dir", str(back), "--hf-cfg-dir", str(hf_dir)]) == 0
    tuned = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    validation = run.rows("validation")[-1]["lm loss"]
    assert relative(hf_loss(tuned, job_batches(args, 1, 1)), validation) <= 1e-5


# -- HF weights at start: MindSpeed-LLM's --enable-hf2mg-convert ------------------------------------------------

def _hf2mg_flags(hf: Path, converted: Path, hf_dir: Path, data_prefix: str, cache: Path, *more: str) -> list[str]:
    """job_flags with --load the HF folder itself, converted by the job (--ckpt-format torch, as their scripts
    say), and MindSpeed-LLM's tokenizer spelling."""
    flags = job_flags(converted, hf_dir, data_prefix, cache, "--skip-train", "--train-iters", "0", "--eval-iters",
                      str(EVAL_ITERS), "--no-npu-compile", *more)
    flags = _without(_without(flags, "--load"), "--tokenizer-model")
    flags = [f for f in flags if f not in ("--finetune", "HuggingFaceTokenizer", "--tokenizer-type")]
    return [*flags, "--load", str(hf), "--enable-hf2mg-convert", "--ckpt-format", "torch", "--tokenizer-type",
            "PretrainedFromHF", "--tokenizer-name-or-path", str(hf_dir)]


@pytest.mark.training
@pytest.mark.any_megatron_line
def test_enable_hf2mg_convert_starts_from_the_hf_folder(converted, hf_dir, data_prefix, cache, hf_model, tmp_path):
    """--load HF --enable-hf2mg-convert --model-type-hf llama3 on 2 processes: rank 0 converts the folder into
    <load>/megatron_cache_tp1pp1_torch while rank 1 waits, the job loads it and evaluates to transformers' loss on
    the same samples; a second start (one process) uses the cache as it is."""
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    flags = _hf2mg_flags(hf, converted, hf_dir, data_prefix, cache, "--model-type-hf", "llama3")
    first = pretrain(tmp_path / "first", *flags, nproc=2, base=[]).check()  # rank 1 waits for rank 0's conversion
    converted_here = hf / "megatron_cache_tp1pp1_torch"
    assert f" --enable-hf2mg-convert: converting {hf} into {converted_here} ..." in first.output
    assert (converted_here / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert f"successfully loaded checkpoint from {converted_here}" in first.output
    job = first.rows("validation")[0]["lm loss"]
    want = hf_loss(hf_model, job_batches(job_args(flags), 1, EVAL_ITERS))
    print(f"--enable-hf2mg-convert: job {job:.7f}, transformers {want:.7f}, relative {relative(job, want):.1e}")
    assert relative(job, want) <= 1e-5
    second = pretrain(tmp_path / "second", *flags, base=[]).check()
    assert f" --enable-hf2mg-convert: using the converted weights in {converted_here}" in second.output
    assert second.rows("validation")[0]["lm loss"] == job


@pytest.mark.any_megatron_line  # config.json's model_type against --model-type-hf, read before megatron-core
def test_enable_hf2mg_convert_refuses_another_family_before_starting(converted, hf_dir, data_prefix, cache, tmp_path,
                                                                    capsys):
    """The door's own main, in this process: the refusal comes from the check it runs before any process group
    (at_start.before_start), so no job process needs starting to see it."""
    from hf_models import process_state_kept
    from megatron_glue import pretrain_gpt

    flags = _hf2mg_flags(hf_dir, converted, hf_dir, data_prefix, cache, "--model-type-hf", "qwen25")
    with process_state_kept():  # the job ends the process group: the session's own comes back after
        code = pretrain_gpt.main([*flags, "--metrics-file", str(tmp_path / "metrics.jsonl")])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert err == (f"pretrain_gpt: error: --load {hf_dir}: --model-type-hf qwen2.5 expects config.json model_type "
                   "qwen2, the config says 'llama'\n")
    assert not (hf_dir / "megatron_cache_tp1pp1_torch").exists()


# -- refusals --------------------------------------------------------------------------------------------------

def _saved_args(mg: Path) -> dict:
    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        from megatron.core import dist_checkpointing
    return dist_checkpointing.load_common_state_dict(str(mg / "release"))["args"]


def _check(args, mg: Path) -> None:
    """What `checkpointing.load_checkpoint` checks first, against the checkpoint's own saved arguments."""
    from megatron_glue.training.checkpointing import check_architecture

    check_architecture(args, _saved_args(mg), str(mg / "release"), reshards=True)


def _flags(mg: Path, tokenizer_dir: Path, *more: str) -> list[str]:
    return [*model_flags(mg), "--load", str(mg), "--finetune", *tokenizer_flags(tokenizer_dir), "--seq-length", "32",
            "--micro-batch-size", "1", "--skip-train", "--train-iters", "0", *more]


def test_the_converted_flags_pass(converted, hf_dir):
    args = job_args(_flags(converted, hf_dir))
    _check(args, converted)
    assert (args.orig_vocab_size, args.padded_vocab_size) == (VOCAB, VOCAB)


def _without(flags: list[str], flag: str) -> list[str]:
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]


def test_defaulted_architecture_flags_compare_as_their_values(converted, hf_dir):
    """model_flags.txt gives --kv-channels 16, the head size (64 / 4): a job that leaves it at its default has the
    same architecture and loads the checkpoint; another head size is refused, naming both values."""
    from megatron_glue.training.checkpointing import CheckpointError

    flags = _flags(converted, hf_dir)
    assert flags[flags.index("--kv-channels") + 1] == "16"
    args = job_args(_without(flags, "--kv-channels"))
    assert args.kv_channels == 16  # stored resolved in the checkpoints this job saves
    _check(args, converted)
    with pytest.raises(CheckpointError) as refused:
        _check(job_args([*flags, "--kv-channels", "8"]), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} was saved with --kv-channels 16, "
                                  "this job has 8; use the checkpoint's value")
    # a checkpoint the job saved while it stored the default unresolved (None) loads with the flag given too
    from megatron_glue.training.checkpointing import check_architecture

    check_architecture(job_args(flags), {**_saved_args(converted), "kv_channels": None}, "old", reshards=True)


@pytest.mark.parametrize("flag, value, saved", [("--num-layers", "3", "2"), ("--hidden-size", "128", "64"),
                                                ("--norm-epsilon", "1e-06", "1e-05"),
                                                ("--rotary-base", "10000", "500000")])
def test_architecture_flags_that_differ_are_refused(flag, value, saved, converted, hf_dir):
    from megatron_glue.training.checkpointing import CheckpointError

    args = job_args(_flags(converted, hf_dir, flag, value))  # given after model_flags.txt's: argparse takes it
    with pytest.raises(CheckpointError) as refused:
        _check(args, converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} was saved with {flag} {saved}, "
                                  f"this job has {value}; use the checkpoint's value")


def test_a_smaller_tokenizer_is_refused_and_vocab_size_fixes_it(converted, other_tokenizers):
    from megatron_glue.training.checkpointing import CheckpointError

    small = other_tokenizers[500]
    with pytest.raises(CheckpointError) as refused:
        _check(job_args(_flags(converted, small)), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} has a vocabulary of 512 tokens, this "
                                  "job's tokenizer gives 500; use the checkpoint's tokenizer, or --vocab-size 512 "
                                  "where the model's embedding is larger than the tokenizer")
    # what the message says: the model's 512 rows for the tokenizer's 500 ids
    args = job_args(_flags(converted, small, "--vocab-size", "512"))
    _check(args, converted)
    assert (args.tokenizer.vocab_size, args.orig_vocab_size, args.padded_vocab_size) == (500, 512, 512)
    with pytest.raises(CheckpointError) as refused:
        _check(job_args(_flags(converted, small, "--vocab-size", "520")), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} has a vocabulary of 512 tokens, this "
                                  "job's --vocab-size gives 520; use --vocab-size 512")


def test_padded_vocab_size_of_the_checkpoint_takes_its_vocabulary(converted, other_tokenizers):
    """MindSpeed-LLM's Qwen scripts: --padded-vocab-size the HF embedding's rows (152064) for a tokenizer of fewer
    ids (151665), no --vocab-size. The converted checkpoint's 512 rows load for the tokenizer's 500 ids, and the
    job's model vocabulary becomes the checkpoint's (what an export writes back); other rows stay refused."""
    from megatron_glue.training.checkpointing import CheckpointError

    small = other_tokenizers[500]
    args = job_args(_flags(converted, small, "--padded-vocab-size", "512"))
    assert (args.tokenizer.vocab_size, args.orig_vocab_size, args.padded_vocab_size) == (500, 500, 512)
    _check(args, converted)
    assert (args.tokenizer.vocab_size, args.orig_vocab_size, args.padded_vocab_size) == (500, 512, 512)
    with pytest.raises(CheckpointError) as refused:
        _check(job_args(_flags(converted, small, "--padded-vocab-size", "640")), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} has a vocabulary of 512 tokens, this "
                                  "job's tokenizer gives 500; use the checkpoint's tokenizer, or --vocab-size 512 "
                                  "where the model's embedding is larger than the tokenizer")


def test_a_larger_tokenizer_is_refused(converted, other_tokenizers):
    from megatron_glue.training.checkpointing import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        _check(job_args(_flags(converted, other_tokenizers[600])), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} has a vocabulary of 512 tokens, this "
                                  "job's tokenizer gives 600, ids the checkpoint has no embedding for; use the "
                                  "checkpoint's tokenizer")


    with pytest.raises(CheckpointError) as refused:  # --vocab-size cannot shrink a tokenizer to the model
        _check(job_args(_flags(converted, other_tokenizers[600], "--vocab-size", "640")), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} has a vocabulary of 512 tokens, fewer "
                                  "than the 600 tokens of this job's tokenizer; use the checkpoint's tokenizer")


def test_a_null_tokenizer_is_told_its_vocab_size(converted, hf_dir):
    """NullTokenizer's vocabulary is --vocab-size + 1 (its eod): the message gives the flag's value that fits."""
    from megatron_glue.training.checkpointing import CheckpointError

    flags = [*_flags(converted, hf_dir), "--tokenizer-type", "NullTokenizer", "--vocab-size"]
    with pytest.raises(CheckpointError) as refused:
        _check(job_args([*flags, "512"]), converted)
    assert str(refused.value) == (f"the checkpoint at {converted / 'release'} has a vocabulary of 512 tokens, this "
                                  "job's NullTokenizer --vocab-size 512 gives 513; use --vocab-size 511")
    _check(job_args([*flags, "511"]), converted)


def test_vocab_size_smaller_than_the_tokenizer_is_refused(converted, hf_dir):
    from megatron_glue.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as refused:
        job_args(_flags(converted, hf_dir, "--vocab-size", "500"))
    assert refused.value.message == ("pretrain_gpt: error: --vocab-size 500 is smaller than the tokenizer's 512 "
                                     "tokens; give at least 512, or leave it out")


@pytest.mark.training
@pytest.mark.parametrize("case", ["num-layers", "tokenizer"])
def test_the_job_refuses_a_mismatch(case, converted, hf_dir, other_tokenizers, tmp_path):
    """The same refusals from the job itself (load_checkpoint): exit status 1, one line."""
    release = converted / "release"
    if case == "num-layers":
        flags = _flags(converted, hf_dir, "--num-layers", "3")
        line = (f"pretrain_gpt: error: the checkpoint at {release} was saved with --num-layers 2, this job has 3; "
                "use the checkpoint's value")
    else:
        flags = _flags(converted, other_tokenizers[500])
        line = (f"pretrain_gpt: error: the checkpoint at {release} has a vocabulary of 512 tokens, this job's "
                "tokenizer gives 500; use the checkpoint's tokenizer, or --vocab-size 512 where the model's embedding "
                "is larger than the tokenizer")
    run = pretrain(tmp_path, *flags, "--distributed-backend", "gloo", base=[])
    assert run.returncode == 1, run.output[-4000:]
    assert line in run.output.splitlines(), run.output[-4000:]
    assert "Traceback" not in run.output

"""MindSpeed-LLM's `--enable-mg2hf-convert`: the job converts each checkpoint its training loop saves into
<--save>/mg2hf_iteration{N}, an HF folder transformers loads, whose weights are the saved checkpoint's.

One launch (2 processes, TP=2, eager, the legacy format with the distributed optimizer, 2 iterations, a save every
iteration) checks the export; the refusals are the
job's door, run in this process (no process group starts)."""

from __future__ import annotations

import glob
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_models
from pretrain_runs import parse_error, parse_tiny, pretrain

FAMILY = "llama3"  # GQA, llama3 rope scaling, untied output layer
VOCAB = 512        # the NullTokenizer's --vocab-size 511 plus its end-of-document token: no padding at TP=2

# conversions in this process set up and tear down Megatron's state: put back after the module
pytestmark = pytest.mark.usefixtures("process_state_kept")


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf_cfg(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    hf_models.save_random_hf(FAMILY, str(folder), vocab_size=VOCAB)
    return folder


def _job(hf_cfg: Path, save: Path, *more: str) -> list[str]:
    from megatron_glue.convert import core, families

    cfg = hf_models.read_config(str(hf_cfg))
    flags = core.architecture_flags(families.family_for(FAMILY, cfg), cfg)
    return [*flags, "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--lr", "1e-3",
            "--lr-decay-style", "constant", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
            "--distributed-backend", "gloo", "--no-progress-bar", "--seed", "7", "--save", str(save),
            "--save-interval", "1", "--enable-mg2hf-convert", "--hf-cfg-dir", str(hf_cfg), "--model-type-hf",
            FAMILY, *more]


@pytest.fixture(scope="module")
def exported(hf_cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    start = time.monotonic()
    # MindSpeed-LLM's checkpoint setup (45 of 48 of its pretraining scripts): the legacy format with the distributed
    # optimizer (the job's default torch_dist is read by the same converter: test_convert.py)
    run = pretrain(root / "run", *_job(hf_cfg, root / "save", "--tensor-model-parallel-size", "2",
                                       "--ckpt-format", "torch", "--use-distributed-optimizer", "--no-npu-compile"),
                   nproc=2, base=[]).check()
    print(f"--enable-mg2hf-convert launch: {time.monotonic() - start:.1f} s", file=sys.stderr)
    return run, root / "save"


@pytest.mark.training
@pytest.mark.any_megatron_line
def test_each_interval_save_is_exported_and_loads_in_transformers(exported, hf_cfg):
    from transformers import AutoModelForCausalLM

    run, save = exported
    for n in (1, 2):
        assert (f" --enable-mg2hf-convert: converting {save / f'iter_{n:07d}'} into {save / f'mg2hf_iteration{n}'}"
                " ...") in run.output
        assert f" --enable-mg2hf-convert: wrote {save / f'mg2hf_iteration{n}'}" in run.output
    assert not list(save.glob("*.partial"))
    model, info = AutoModelForCausalLM.from_pretrained(save / "mg2hf_iteration2", output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.isfinite(model(hf_models.tokens()).logits).all()
    # the config files are --hf-cfg-dir's
    assert (save / "mg2hf_iteration2" / "generation_config.json").read_text() == \
        (hf_cfg / "generation_config.json").read_text()
    # training moved the weights between the two saves, and from the HF folder the config came from
    one, two, start = (_weights(save / "mg2hf_iteration1"), _weights(save / "mg2hf_iteration2"), _weights(hf_cfg))
    assert sorted(one) == sorted(two) == sorted(start)
    assert all(not torch.equal(one[k], two[k]) for k in two if k.endswith("proj.weight"))


@pytest.mark.training
@pytest.mark.any_megatron_line
def test_the_export_is_the_saved_checkpoint_bitwise(exported, tmp_path):
    """mg2hf_iteration2 converted back to Megatron's legacy files at TP=2 equals what the job saved at iteration 2,
    rank by rank, every model tensor, bitwise."""
    from megatron_glue.convert import core

    _, save = exported
    back = tmp_path / "back"
    core.hf_to_mg(str(save / "mg2hf_iteration2"), str(back), FAMILY, tp=2, ckpt_format="torch")
    for rank in ("mp_rank_00", "mp_rank_01"):
        ours = torch.load(back / "release" / rank / "model_optim_rng.pt", weights_only=False)["model"]
        saved = torch.load(save / "iter_0000002" / rank / "model_optim_rng.pt", weights_only=False)["model"]
        tensors = sorted(k for k, v in ours.items() if isinstance(v, torch.Tensor))
        assert tensors == sorted(k for k, v in saved.items() if isinstance(v, torch.Tensor))
        assert len(tensors) == 2 * 6 + 3  # two layers of 6, embedding, final norm, output layer
        for key in tensors:
            assert ours[key].dtype == saved[key].dtype and torch.equal(ours[key], saved[key]), (rank, key)


def test_only_convert_last_checkpoint_skips_the_others():
    """--only-convert-last-checkpoint: the saves before --train-iters are not exported (no process group needed:
    nothing runs)."""
    from megatron_glue.convert import at_save

    args = types.SimpleNamespace(only_convert_last_checkpoint=True, train_iters=4, save="/nonexistent",
                                 hf_save_dir=None)
    assert at_save.export(args, 2) is None
    assert at_save.target_dir(args, 4) == "/nonexistent/mg2hf_iteration4"
    args.hf_save_dir = "/elsewhere"
    assert at_save.target_dir(args, 4) == "/elsewhere/mg2hf_iteration4"


# -- the argument check -----------------------------------------------------------------------------------------

def test_the_flags_and_their_defaults(tmp_path):
    args = parse_tiny("--save", str(tmp_path), "--save-interval", "3", "--enable-mg2hf-convert", "--hf-cfg-dir",
                      "HF", "--only-convert-last-checkpoint", "--hf-save-dir", str(tmp_path / "hf"))
    assert (args.enable_mg2hf_convert, args.only_convert_last_checkpoint, args.hf_cfg_dir, args.hf_save_dir) == (
        True, True, "HF", str(tmp_path / "hf"))
    # MindSpeed-LLM's default: with --enable-hf2mg-convert, the config comes from the HF folder --load names
    args = parse_tiny("--save", str(tmp_path), "--save-interval", "3", "--enable-mg2hf-convert",
                      "--enable-hf2mg-convert", "--load", "HF_FOLDER")
    assert args.hf_cfg_dir == "HF_FOLDER"
    assert parse_tiny("--hf-cfg-dir", "HF").hf_cfg_dir == "HF"  # alone it changes nothing, as in MindSpeed-LLM


@pytest.mark.parametrize("flags, line", [
    (("--enable-mg2hf-convert", "--hf-cfg-dir", "HF"),
     "--enable-mg2hf-convert needs --save: it converts the checkpoints the job saves there"),
    (("--enable-mg2hf-convert", "--hf-cfg-dir", "HF", "--save", "{tmp}"),
     "--enable-mg2hf-convert converts the checkpoints the training loop saves every --save-interval iterations; "
     "give --save-interval"),
    (("--enable-mg2hf-convert", "--save", "{tmp}", "--save-interval", "1"),
     "--enable-mg2hf-convert needs --hf-cfg-dir, the HF folder whose config.json the exported folders get "
     "(transformers cannot load weights without it); with --enable-hf2mg-convert it is --load"),
    (("--enable-mg2hf-convert", "--hf-cfg-dir", "HF", "--save", "{tmp}", "--save-interval", "2",
      "--only-convert-last-checkpoint"),
     "--only-convert-last-checkpoint converts the save at iteration --train-iters 3, which the training loop makes "
     "only when --save-interval divides it (2 does not)"),
    (("--hf-save-dir", "{tmp}"),
     "--hf-save-dir says which saves --enable-mg2hf-convert converts, and where; give --enable-mg2hf-convert with "
     "it, or drop it"),
    (("--only-convert-last-checkpoint",),
     "--only-convert-last-checkpoint says which saves --enable-mg2hf-convert converts, and where; give "
     "--enable-mg2hf-convert with it, or drop it"),
    (("--mg-save-dir", "{tmp}"),
     "--mg-save-dir is where --enable-hf2mg-convert puts the converted weights; give both, or neither"),
])
def test_argument_refusals(flags, line, tmp_path):
    assert parse_error(*(f.format(tmp=tmp_path) for f in flags)).endswith(f"error: {line}")


# -- the door: refused before any process group starts ------------------------------------------------------------

def _door(argv: list[str], capsys) -> tuple[int, str]:
    from megatron_glue.pretrain_gpt import main
    from megatron_glue.training import checkpointing

    code = main(argv)
    checkpointing.AFTER_INTERVAL_SAVE.clear()
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_family_the_converter_lacks_is_refused(hf_cfg, tmp_path, capsys):
    code, line = _door(_job(hf_cfg, tmp_path / "save", "--model-type-hf", "deepseek3"), capsys)
    assert code == 2
    assert line.startswith("python -m megatron_glue.pretrain_gpt: error: --model-type-hf deepseek3: converting "
                           "deepseek3 checkpoints to HF at save is not implemented here (the converter's families: ")
    assert line.endswith("); drop --enable-mg2hf-convert")


def test_a_config_of_another_family_is_refused(hf_cfg, tmp_path, capsys):
    code, line = _door(_job(hf_cfg, tmp_path / "save", "--model-type-hf", "qwen3"), capsys)
    assert (code, line) == (1, f"pretrain_gpt: error: --enable-mg2hf-convert: --hf-cfg-dir {hf_cfg}: --model-type-hf "
                               "qwen3 expects config.json model_type qwen3, the config says 'llama'")
    assert not (tmp_path / "save").exists()


def test_a_config_of_another_architecture_is_refused(hf_cfg, tmp_path, capsys):
    argv = _job(hf_cfg, tmp_path / "save")
    argv[argv.index("--num-layers") + 1] = "3"
    code, line = _door(argv, capsys)
    assert code == 1
    assert line.startswith(f"pretrain_gpt: error: --enable-mg2hf-convert: --hf-cfg-dir {hf_cfg}: its config.json "
                           "gives num_layers 2 (llama: ")
    assert line.endswith("the job's flags give 3: it describes another model")


def test_a_folder_without_config_is_refused(tmp_path, hf_cfg, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = _job(hf_cfg, tmp_path / "save")
    argv[argv.index("--hf-cfg-dir") + 1] = str(empty)
    assert _door(argv, capsys) == (1, f"pretrain_gpt: error: --hf-cfg-dir {empty}: no config.json there; "
                                      "--enable-mg2hf-convert gives the exported folders the config files of an HF "
                                      "folder of this model")


def test_an_unwritable_target_is_named(tmp_path, hf_cfg, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, line = _door(_job(hf_cfg, tmp_path / "save", "--hf-save-dir", str(blocker / "hf")), capsys)
    assert (code, line) == (1, f"pretrain_gpt: error: --hf-save-dir {blocker / 'hf'} lies under {blocker}, which is "
                               "a file; give a folder path")
    code, line = _door(_job(hf_cfg, tmp_path / "save", "--hf-save-dir", str(blocker)), capsys)
    assert (code, line) == (1, f"pretrain_gpt: error: --hf-save-dir {blocker} is a file; the mg2hf_iteration<N> "
                               "folders of --enable-mg2hf-convert go in a folder")



def test_mg_save_dir_names_the_hf2mg_cache():
    """MindSpeed-LLM's --mg-save-dir (initialize.py:258-282): where --enable-hf2mg-convert puts its weights."""
    from megatron_glue.convert import at_start

    args = parse_tiny("--enable-hf2mg-convert", "--load", "HF", "--mg-save-dir", "/somewhere/cache")
    assert at_start.cache_dir(args) == "/somewhere/cache"
    assert at_start.cache_dir(parse_tiny("--enable-hf2mg-convert", "--load", "HF")) == \
        "HF/megatron_cache_tp1pp1_torch_dist"


def test_a_config_of_another_vocabulary_is_refused(hf_cfg, tmp_path, capsys):
    argv = _job(hf_cfg, tmp_path / "save")
    argv[argv.index("--vocab-size") + 1] = "99"
    assert _door(argv, capsys) == (1, f"pretrain_gpt: error: --enable-mg2hf-convert: --hf-cfg-dir {hf_cfg}: its "
                                      f"config.json gives vocab_size {VOCAB}; the job's vocabulary has 100 tokens "
                                      "(its tokenizer, or --vocab-size where the model's embedding is larger): it "
                                      "describes another model")


def _export_on_rank(args) -> str:
    """One rank of a fresh process (megatron_glue.capture.distributed.run_on_ranks): the export's outcome."""
    import os

    import torch.distributed as dist

    from megatron_glue.convert import at_save
    from megatron_glue.training.checkpointing import CheckpointError

    dist.init_process_group("gloo", init_method=f"file://{os.environ['NPU_COMPILE_STORE']}",
                            rank=int(os.environ["RANK"]), world_size=2)
    try:
        at_save.export(args, 7)
        return "exported"
    except CheckpointError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.gloo
def test_a_failed_export_stops_every_rank_with_rank_0s_line(hf_cfg, tmp_path):
    """Rank 0's conversion fails (the saved folder is not a checkpoint): rank 1, waiting for it, gets its line."""

    save = tmp_path / "save"
    (save / "iter_0000007").mkdir(parents=True)
    args = types.SimpleNamespace(only_convert_last_checkpoint=False, train_iters=7, save=str(save), hf_save_dir=None,
                                 hf_cfg_dir=str(hf_cfg), model_type_hf=FAMILY)
    # fresh processes: a forked child of a test worker would inherit its default process group
    from megatron_glue.capture.distributed import run_on_ranks

    outcomes = run_on_ranks(_export_on_rank, args, world_size=2, timeout=180)
    line = (f"--enable-mg2hf-convert: converting {save / 'iter_0000007'} into {save / 'mg2hf_iteration7'} failed: "
            f"--load-dir {save / 'iter_0000007'}: no latest_checkpointed_iteration.txt and no checkpoint files; "
            "expected a Megatron checkpoint directory")
    assert outcomes == [line, line]
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000007"]

"""`npu-compile preprocess --handler-name AlpacaStyleInstructionHandler --prompt-type NAME`: MindSpeed-LLM's
instruction datasets (three `_packed_*_document` datasets, prompt labelled -100), token by token."""

import json

import numpy as np
import pytest

from megatron_glue.data import instruction
from megatron_glue.data import preprocess as pp

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A local HF tokenizer whose token id is the byte value (byte-level BPE without merges), the specials 256 on:
    expected ids are then the text's UTF-8 bytes, independent of any encoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    from_byte = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(from_byte.values()) == set(alphabet)
    vocab = {from_byte[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # ids 256, 257, ... in this order
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|begin_of_text|>",
                                   additional_special_tokens=SPECIALS[1:])
    assert fast.convert_tokens_to_ids(SPECIALS) == list(range(256, 256 + len(SPECIALS)))
    path = str(tmp_path_factory.mktemp("byte_tokenizer"))
    fast.save_pretrained(path)
    return path


def _bytes_to_unicode():
    # GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet), in byte order
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def _sp(token):
    return 256 + SPECIALS.index(token)


def _b(text):
    return list(text.encode())


RECORDS = [{"instruction": "Add", "input": "1+1", "output": "2"},
           {"instruction": "Say hi", "input": "", "output": "hi there"}]


def _run(tmp_path, tokenizer, prompt_type, *extra, records=RECORDS):
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix = str(tmp_path / "out" / "alpaca")
    rc = pp.main(["--input", str(data), "--tokenizer-name-or-path", tokenizer, "--output-prefix", prefix,
                  "--handler-name", "AlpacaStyleInstructionHandler", "--tokenizer-type", "PretrainedFromHF",
                  "--prompt-type", prompt_type, *extra])
    return rc, prefix


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = {}
    for key in ("input_ids", "attention_mask", "labels"):
        ds = IndexedDataset(f"{prefix}_packed_{key}_document")
        assert ds.index.dtype == np.int32
        out[key] = [ds[i].tolist() for i in range(len(ds))]
    return out


def test_qwen_template_ids_and_labels(tmp_path, byte_tokenizer):
    rc, prefix = _run(tmp_path, byte_tokenizer, "qwen", "--workers", "2")
    assert rc == 0
    got = _read(prefix)
    start, end = _sp("<|im_start|>"), _sp("<|im_end|>")
    prompt = ([start] + _b("system\nYou are a helpful assistant.") + [end] + _b("\n")
              + [start] + _b("user\nAdd\n1+1") + [end] + _b("\n") + [start] + _b("assistant\n"))
    answer = _b("2") + [end]  # eos replaced by the stop word <|im_end|>
    assert got["input_ids"][0] == prompt + answer
    assert got["labels"][0] == [-100] * len(prompt) + answer
    assert got["attention_mask"][0] == [1] * len(prompt + answer)
    assert got["input_ids"][1][-len(_b("hi there")) - 1:] == _b("hi there") + [end]
    assert _b("user\nSay hi") + [end] in [got["input_ids"][1][i:i + 12] for i in range(len(got["input_ids"][1]))]


def test_llama3_template_bos_no_system(tmp_path, byte_tokenizer):
    rc, prefix = _run(tmp_path, byte_tokenizer, "llama3")
    assert rc == 0
    got = _read(prefix)
    sh, eh, eot = _sp("<|start_header_id|>"), _sp("<|end_header_id|>"), _sp("<|eot_id|>")
    prompt = ([_sp("<|begin_of_text|>"), sh] + _b("user") + [eh] + _b("\n\nAdd\n1+1") + [eot, sh]
              + _b("assistant") + [eh] + _b("\n\n"))
    assert got["input_ids"][0] == prompt + _b("2") + [eot]
    assert got["labels"][0] == [-100] * len(prompt) + _b("2") + [eot]


def test_seq_length_cuts_and_drops_as_mindspeed(tmp_path, byte_tokenizer):
    long = {"instruction": "x" * 30, "input": "", "output": "y" * 30}
    rc, prefix = _run(tmp_path, byte_tokenizer, "llama3", "--seq-length", "40", records=[RECORDS[0], long])
    assert rc == 0
    got = _read(prefix)
    # the long record is cut to 40 tokens by the template (prompt and answer in proportion), then dropped: >= 40
    assert len(got["input_ids"]) == 1 and got["input_ids"][0][-2:] == _b("2") + [_sp("<|eot_id|>")]
    # the cut itself: 23 prompt + 31 answer tokens in room 40 -> answer int(40 * 31 / 54) = 22, prompt 18
    pairs = instruction._make_pairs([[1] * 23, [2] * 31], 40)
    assert [len(s) for s in pairs[0]] == [18, 22]


@pytest.mark.parametrize("name, why", [
    ("bailing_mini", "a ReasoningTemplate"), ("chatglm3", "not transcribed yet"), ("nope", "not a MindSpeed-LLM template")])
def test_unbuilt_templates_refused_by_name(name, why, tmp_path, byte_tokenizer, capsys):
    with pytest.raises(SystemExit):
        _run(tmp_path, byte_tokenizer, name)
    err = capsys.readouterr().err
    assert f"--prompt-type {name} is " in err and why in err and "supported: qwen, llama3" in err


def test_instruction_flags_still_refused(tmp_path, byte_tokenizer, capsys):
    for extra, msg in ((["--json-keys", "text", "more"], "--json-keys is not taken"),
                       (["--enable-thinking", "true"], "--enable-thinking: --prompt-type qwen has no thinking blocks"),
                       (["--enable-thinking", "maybe"], "--enable-thinking takes true, false or none")):
        with pytest.raises(SystemExit):
            _run(tmp_path, byte_tokenizer, "qwen", *extra)
        assert msg in capsys.readouterr().err
    for extra, msg in ((["--pack"], "--pack needs --seq-length"), (["--neat-pack", "--seq-length", "64"],
                                                                   "--neat-pack needs --pack")):
        assert _run(tmp_path, byte_tokenizer, "qwen", *extra)[0] == 1
        assert msg in capsys.readouterr().err
    for flag in (["--prompt-type", "qwen"], ["--pack"]):  # pretraining documents take neither
        with pytest.raises(SystemExit):
            pp.main(["--input", "x.jsonl", "--output-prefix", "o", *flag])
        assert f"{flag[0]} is taken here only for instruction data" in capsys.readouterr().err


def test_missing_output_key_names_the_line(tmp_path, byte_tokenizer, capsys):
    rc, prefix = _run(tmp_path, byte_tokenizer, "qwen", records=[RECORDS[0], {"instruction": "a"}])
    assert rc == 1
    err = capsys.readouterr().err
    assert "alpaca.jsonl:2: no key 'output'" in err
    assert not (tmp_path / "out" / "alpaca_packed_labels_document.bin").exists()


# -- -m megatron_glue.posttrain_gpt ---------------------------------------------------------------------------

def _alpaca_records(n=20):
    return [{"instruction": f"Count {i}", "input": "" if i % 3 else "go", "output": f"{i} {i + 1} {i + 2}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def sft_data(byte_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_data")
    rc, prefix = _run(folder, byte_tokenizer, "llama3", "--seq-length", "64", records=_alpaca_records())
    assert rc == 0
    return prefix


def _sft_args(tokenizer, prefix, *extra):
    from megatron_glue.training.arguments import parse_args

    return parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "64",
                       "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                       "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-3", "--tokenizer-type",
                       "PretrainedFromHF", "--tokenizer-name-or-path", tokenizer, "--data-path", prefix, "--split",
                       "100,0,0", "--stage", "sft", "--is-instruction-dataset", "--prompt-type", "llama3",
                       "--handler-name", "AlpacaStyleInstructionHandler", *extra], world_size=1)


def test_sft_batch_counts_answer_tokens_only(byte_tokenizer, sft_data):
    from megatron_glue.training import gpt, sft

    args = _sft_args(byte_tokenizer, sft_data)
    gpt.set_vocabulary(args)
    train, valid, test = sft.datasets_provider(args)
    assert valid is None and test is None and len(train) == 3 * 4 + 8  # whole epochs of the 20 documents
    # MindSpeed-LLM's order: epochs of the documents, each shuffled by one RandomState(seed)
    rng = np.random.RandomState(args.seed)
    first = np.arange(20)
    rng.shuffle(first)
    assert train.order[:20].tolist() == first.tolist()
    doc = int(train.order[0])
    stored = _read(sft_data)
    ids, labels = stored["input_ids"][doc], stored["labels"][doc]
    item = {k: v[0] for k, v in train.collate([train[0]]).items()}
    n = len(ids)
    eot = _sp("<|eot_id|>")
    record = _alpaca_records()[doc]
    answer = _b(record["output"]) + [eot]
    assert item["tokens"][:n].tolist() == ids and item["tokens"][n:].eq(eot).all()  # padded with the stop word
    # position i predicts token i + 1; counted exactly where i + 1 is an answer token
    counted = item["loss_mask"].nonzero().view(-1).tolist()
    assert counted == list(range(n - len(answer) - 1, n - 1))
    assert item["labels"][counted].tolist() == answer and labels[-len(answer):] == answer
    assert item["labels"][item["loss_mask"] == 0].eq(0).all() and item["position_ids"].tolist() == list(range(64))


def test_posttrain_refusals(byte_tokenizer, sft_data):
    from megatron_glue.training import sft
    from megatron_glue.training.arguments import ArgumentError, parse_args

    assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data)) is None
    assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, "--stage", "dpo")).startswith(
        "--stage dpo: only --stage sft is implemented here")
    assert "ReasoningTemplate" in sft.posttrain_refusal(
        _sft_args(byte_tokenizer, sft_data, "--prompt-type", "bailing_mini"))
    for extra, msg in ((["--neat-pack"], "--neat-pack needs --reset-attention-mask"),
                       (["--reset-position-ids"], "--reset-position-ids needs --reset-attention-mask"),
                       (["--eod-mask-loss"], "--eod-mask-loss is not taken by posttrain_gpt"),
                       (["--pad-to-multiple-of", "16"], "--pad-to-multiple-of rounds the batches of "
                                                         "--no-pad-to-seq-lengths")):
        assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, *extra)).startswith(msg)
    for extra in (["--reset-attention-mask", "--neat-pack", "--reset-position-ids", "--padded-samples"],
                  ["--no-pad-to-seq-lengths", "--pad-to-multiple-of", "16"], ["--prompt-type", "qwen3"]):
        assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, *extra)) is None
    assert sft.pretrain_refusal(_sft_args(byte_tokenizer, sft_data)).endswith("-m megatron_glue.posttrain_gpt")
    with pytest.raises(ArgumentError) as info:  # a preprocessing flag
        parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--mock-data",
                    "--pack"], world_size=1)
    assert "--pack: --pack is npu-compile preprocess's flag" in info.value.message


@pytest.mark.slow
@pytest.mark.training
def test_posttrain_compiled_equals_eager(byte_tokenizer, sft_data, tmp_path):
    """3 iterations of instruction tuning (llama3 template, padded to 64): losses and gradient norms of the
    compiled job within 1e-5 of --no-npu-compile; the loss is over the answers only (the batch test above)."""
    from pretrain_runs import TINY, assert_close, pretrain

    base = list(TINY)
    del base[base.index("--mock-data")]
    del base[base.index("--vocab-size"):base.index("--vocab-size") + 2]
    for flag, value in (("--seq-length", "64"), ("--max-position-embeddings", "64"), ("--num-layers", "1")):
        base[base.index(flag) + 1] = value
    base += ["--data-path", sft_data, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
             byte_tokenizer, "--split", "100,0,0", "--train-iters", "3", "--eval-iters", "0", "--stage", "sft",
             "--is-instruction-dataset", "--prompt-type", "llama3", "--handler-name", "AlpacaStyleInstructionHandler"]
    module = "megatron_glue.posttrain_gpt"
    compiled = pretrain(tmp_path / "compiled", base=base, module=module).check()
    eager = pretrain(tmp_path / "eager", "--no-npu-compile", base=base, module=module).check()
    assert len(compiled.losses) == 3 and compiled.losses[-1] < compiled.losses[0]
    assert_close(compiled.losses, eager.losses, what="losses")
    norms = [[r["grad_norm"] for r in run.rows("train")] for run in (compiled, eager)]
    assert_close(*norms, what="grad norms")


def test_sharegpt_multi_turn_with_system(tmp_path, byte_tokenizer, capsys):
    """Two exchanges and a system message through the qwen template: every answer kept in the labels (each ends
    with <|im_end|>), every prompt turn -100, the turns after the first led by the template's separator."""
    record = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Yo"}, {"from": "human", "value": "Bye"},
                                {"from": "gpt", "value": "Ciao"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(record) + "\n" + json.dumps({"conversations": [{"from": "human", "value": "x"}]}) + "\n")
    args = ["--input", str(data), "--tokenizer-name-or-path", byte_tokenizer, "--output-prefix",
            str(tmp_path / "chat"), "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen"]
    assert pp.main(args) == 1  # the second record ends with a human turn
    assert "chat.jsonl:2: the conversation ends with a human turn" in capsys.readouterr().err
    data.write_text(json.dumps(record) + "\n")
    assert pp.main(args) == 0
    got = _read(str(tmp_path / "chat"))
    start, end = _sp("<|im_start|>"), _sp("<|im_end|>")
    first = ([start] + _b("system\nBe brief.") + [end] + _b("\n") + [start] + _b("user\nHi") + [end] + _b("\n")
             + [start] + _b("assistant\n"))
    second = _b("\n") + [start] + _b("user\nBye") + [end] + _b("\n") + [start] + _b("assistant\n")
    a1, a2 = _b("Yo") + [end], _b("Ciao") + [end]
    assert got["input_ids"] == [first + a1 + second + a2]
    assert got["labels"] == [[-100] * len(first) + a1 + [-100] * len(second) + a2]

"""Instruction tuning: chat rendering, assistant-only loss mask, packing, truncation, and a fine-tuning run."""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch
from tiktoken_fixtures import write_tiktoken_model

from llamatron.commands.preprocess import add_preprocess_arguments
from llamatron.data.batches import collate
from llamatron.data.indexed import DataError, IndexedDataset
from llamatron.data.preprocess import BadInputError
from llamatron.data.sft import (
    CHATML,
    ChatRenderer,
    ConversationEncoder,
    chat_template,
    conversation_from_record,
    mask_prefix,
    preprocess_conversations,
)
from llamatron.data.sft_dataset import SFTDataset, build_sft_datasets, pack_conversations
from llamatron.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from llamatron.models import IGNORE_INDEX

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Green, obviously."},
]
ANIMALS = ["llama", "alpaca", "camel", "vicuna", "guanaco", "dromedary"]


def animal_conversations(count, seed=0):
    """Learnable: the answer is fixed by the question; answers differ in length."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        a, times = ANIMALS[int(rng.integers(len(ANIMALS)))], int(rng.integers(1, 5))
        turns = [
            {"role": "user", "content": f"Say {a} {times} times."},
            {"role": "assistant", "content": " ".join([a] * times) + "."},
        ]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "Answer about animals."}] + turns
        if i % 4 == 0:
            turns += [{"role": "user", "content": "Again?"}, {"role": "assistant", "content": f"{a}!"}]
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft_tokenizer"))
    texts = [json.dumps(c) for c in animal_conversations(200)] + [json.dumps(CONVERSATION)] * 5
    texts += ["<|im_start|>assistant\n<|im_end|>\n [INST] [/INST] <<SYS>> <</SYS>>"] * 20
    train_bpe_tokenizer(texts, vocab_size=400, out_dir=out)
    return out


@pytest.fixture(scope="module")
def template_tokenizer_dir(tokenizer_dir, tmp_path_factory):
    """The same tokenizer with a Llama-2 style chat template in tokenizer_config.json."""
    out = str(tmp_path_factory.mktemp("template_tokenizer"))
    load_tokenizer(tokenizer_dir).save(out)
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ '<<SYS>> ' + m['content'] + ' <</SYS>> ' }}"
        "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}"
        "{% endfor %}"
    )
    with open(config_path, "w") as f:
        json.dump(config, f)
    return out


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def trained_runs(tokens, mask):
    """Contiguous runs of tokens under the mask."""
    runs, current = [], []
    for token, m in zip(tokens.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_chatml_rendering_and_assistant_only_mask(tokenizer_dir):
    encoder = ConversationEncoder(tokenizer_dir)
    assert encoder.renderer.format == "chatml"
    [(tokens, mask)] = encoder.encode([{"messages": CONVERSATION}])
    tok = load_tokenizer(tokenizer_dir)
    expected_text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert tok.decode(tokens) == expected_text
    assert mask.dtype == np.uint8 and set(mask.tolist()) == {0, 1}
    # exactly the assistant replies and their end-of-turn marker are trained
    assert [tok.decode(run) for run in trained_runs(tokens, mask)] == ["Blue.<|im_end|>", "Green, obviously.<|im_end|>"]
    untrained = tok.decode(tokens[mask == 0])
    assert "You are terse." in untrained and "Name a colour." in untrained and "Blue" not in untrained


def test_chat_template_from_tokenizer_directory(template_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    encoder = ConversationEncoder(template_tokenizer_dir)
    assert encoder.renderer.format == "chat template"
    [(tokens, mask)] = encoder.encode([{"messages": CONVERSATION}])
    tok = load_tokenizer(template_tokenizer_dir)
    hf = transformers.AutoTokenizer.from_pretrained(template_tokenizer_dir)
    assert tok.decode(tokens) == hf.apply_chat_template(CONVERSATION, tokenize=False)
    eos = tok.eod_token
    assert [tok.decode(run) for run in trained_runs(tokens, mask)] == [f" Blue.{eos}", f" Green, obviously.{eos}"]


def test_template_that_rewrites_earlier_turns_is_refused(template_tokenizer_dir, tmp_path):
    pytest.importorskip("transformers")
    renderer = ChatRenderer(template_tokenizer_dir)
    # a template that numbers turns from the end changes earlier text as turns are added
    renderer._hf.chat_template = (
        "{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}{% endfor %}"
    )
    with pytest.raises(DataError, match="changes the text of earlier messages"):
        renderer.segments(CONVERSATION)


def test_prompt_response_records_match_messages(tokenizer_dir):
    pair = {"instruction": "Name a colour.", "output": "Blue.", "sys": "You are terse."}
    encoder = ConversationEncoder(tokenizer_dir, prompt_key="instruction", response_key="output", system_key="sys")
    [(tokens, mask)] = encoder.encode([pair])
    [(expected_tokens, expected_mask)] = ConversationEncoder(tokenizer_dir).encode([{"messages": CONVERSATION[:3]}])
    assert tokens.tolist() == expected_tokens.tolist() and mask.tolist() == expected_mask.tolist()


@pytest.mark.parametrize(
    "record, kind",
    [
        ({"text": "no messages"}, "missing key 'messages'"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, "empty document"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "needs a role"),
        ({"messages": [{"role": "user", "content": 3}]}, "no string content"),
    ],
)
def test_bad_conversations_are_named(record, kind):
    from llamatron.data.preprocess import RecordError

    with pytest.raises(RecordError, match=kind):
        conversation_from_record(record)


def test_preprocess_sft_writes_tokens_and_mask(tokenizer_dir, tmp_path):
    records = animal_conversations(40) + ['{"messages": [oops', {"messages": [{"role": "user", "content": "x"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    with pytest.raises(BadInputError, match=r"chat\.jsonl:41: malformed JSON"):
        preprocess_conversations(path, str(tmp_path / "strict"), tokenizer_dir, progress=False)
    summary = preprocess_conversations(
        path, str(tmp_path / "out"), tokenizer_dir, skip_bad_lines=True, progress=False, workers=2
    )
    assert summary["documents"] == 40 and summary["bad_lines"] == 2
    assert summary["bad_line_kinds"] == {"malformed JSON": 1, "no assistant message": 1}
    tokens, mask = IndexedDataset(str(tmp_path / "out_sft")), IndexedDataset(mask_prefix(str(tmp_path / "out_sft")))
    assert summary["outputs"]["tokens"] == str(tmp_path / "out_sft")
    assert np.array_equal(tokens.sizes, mask.sizes) and mask.dtype == np.uint8
    assert summary["tokens"] == tokens.num_tokens
    assert summary["trained_tokens"] == sum(int(mask[i].sum()) for i in range(len(mask))) > 0
    encoder = ConversationEncoder(tokenizer_dir)
    for i in (0, 7, 39):  # same as encoding in this process
        [(t, m)] = encoder.encode([records[i]])
        assert tokens[i].tolist() == t.tolist() and mask[i].tolist() == m.tolist()


def test_cli_sft_flags(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"q": "Name a colour.", "a": "Blue."}])
    cmd = [
        sys.executable,
        "-m",
        "llamatron",
        "preprocess",
        "--sft",
        "--input",
        path,
        "--output-prefix",
        str(tmp_path / "pairs"),
        "--tokenizer",
        tokenizer_dir,
        "--prompt-key",
        "q",
        "--response-key",
        "a",
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--sft-data " + str(tmp_path / "pairs_sft") in done.stderr and "assistant (trained) tokens" in done.stderr
    assert len(IndexedDataset(str(tmp_path / "pairs_sft"))) == 1


def test_pack_conversations_best_fit():
    offsets, items = pack_conversations(np.array([6, 4, 5, 5, 3, 7]), capacity=10)
    bins = [sorted(items[offsets[b] : offsets[b + 1]].tolist()) for b in range(offsets.size - 1)]
    assert sorted(bins) == [[0, 1], [2, 3], [4, 5]]  # 6+4, 5+5, 7+3: three full bins
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    offsets, items = pack_conversations(lengths, capacity=64)
    assert sorted(items.tolist()) == list(range(500))  # every conversation exactly once
    sums = np.add.reduceat(lengths[items], offsets[:-1])
    assert sums.max() <= 64
    assert offsets.size - 1 <= int(np.ceil(lengths.sum() / 64 * 1.1)) + 1  # close to the lower bound
    again = pack_conversations(lengths, capacity=64)
    assert np.array_equal(again[0], offsets) and np.array_equal(again[1], items)
    with pytest.raises(ValueError):
        pack_conversations(np.array([65]), capacity=64)


@pytest.fixture(scope="module")
def sft_prefix(tokenizer_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("sft_data")
    path = write_jsonl(work / "animals.jsonl", animal_conversations(300))
    return preprocess_conversations(path, str(work / "animals"), tokenizer_dir, progress=False)["outputs"]["tokens"]


def test_packed_samples(sft_prefix):
    tokens, mask = IndexedDataset(sft_prefix), IndexedDataset(mask_prefix(sft_prefix))
    seq = 48
    conversations = np.arange(len(tokens))
    num_sequences = SFTDataset(tokens, mask, conversations, seq, 1, seed=0).num_sequences
    dataset = SFTDataset(tokens, mask, conversations, seq, num_sequences * 2, seed=0)
    assert dataset.truncated == int((tokens.sizes > seq + 1).sum()) > 0  # some conversations exceed 49 tokens
    assert dataset.fill > 0.8
    seen = []
    for i in range(num_sequences):  # one epoch: every conversation once
        sample = dataset[i]
        assert {k: v.shape for k, v in sample.items()} == {
            k: (seq + 1,) for k in ("tokens", "loss_mask", "document_ids", "position_ids")
        }
        docs = sample["document_ids"]
        members = dataset.bin_items[
            dataset.bin_offsets[int(dataset.sample_order[i])] : dataset.bin_offsets[int(dataset.sample_order[i]) + 1]
        ]
        for k, conversation in enumerate(members.tolist()):
            where = np.flatnonzero(docs == k)
            n = min(int(tokens.sizes[conversation]), seq + 1)
            assert where.tolist() == list(range(where[0], where[0] + n))  # contiguous, whole (or truncated)
            assert sample["tokens"][where].tolist() == tokens[conversation][:n].tolist()
            assert sample["position_ids"][where].tolist() == list(range(n))
            expected_mask = mask[conversation][:n].astype(bool)
            expected_mask[0] = False
            assert sample["loss_mask"][where].tolist() == expected_mask.tolist()
            seen.append(conversation)
        padding = docs == len(members)
        assert not sample["loss_mask"][padding].any()
    assert sorted(seen) == list(range(len(tokens)))
    second_epoch = sorted(int(s) for s in dataset.sample_order[num_sequences:])
    assert second_epoch == list(range(num_sequences))


def test_labels_never_cross_conversations(sft_prefix):
    tokens, mask = IndexedDataset(sft_prefix), IndexedDataset(mask_prefix(sft_prefix))
    dataset = SFTDataset(tokens, mask, np.arange(len(tokens)), 48, 16, seed=1)
    batch = collate([dataset[i] for i in range(16)])
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    trained = batch["labels"] != IGNORE_INDEX
    # a label is trained only where the next token belongs to the same conversation
    next_docs = torch.from_numpy(np.stack([dataset[i]["document_ids"][1:] for i in range(16)]))
    assert (next_docs[trained] == batch["document_ids"][trained]).all()
    assert trained.sum() > 0


def test_no_pack_pads_one_conversation_per_sample(sft_prefix):
    tokens, mask = IndexedDataset(sft_prefix), IndexedDataset(mask_prefix(sft_prefix))
    dataset = SFTDataset(tokens, mask, np.arange(len(tokens)), 48, 20, seed=0, pack=False)
    assert dataset.num_sequences == len(tokens)
    for i in range(20):
        sample = dataset[i]
        assert set(sample) == {"tokens", "loss_mask"}
        conversation = int(dataset.sample_order[i])
        n = min(int(tokens.sizes[conversation]), 49)
        assert sample["tokens"][:n].tolist() == tokens[conversation][:n].tolist()
        assert not sample["tokens"][n:].any() and not sample["loss_mask"][n:].any()


def test_build_sft_datasets_split_cache_and_checks(sft_prefix, tokenizer_dir, tmp_path):
    train, valid = build_sft_datasets(sft_prefix, "90,10,0", 48, 30, 5, seed=0)
    assert len(train) == 30 and len(valid) == 5
    assert set(train.conversations.tolist()).isdisjoint(valid.conversations.tolist())
    again, _ = build_sft_datasets(sft_prefix, "90,10,0", 48, 30, 5, seed=0)
    assert again.loaded_from_cache and all(np.array_equal(train[i]["tokens"], again[i]["tokens"]) for i in range(30))
    with pytest.raises(DataError, match=r"animals_sft\.bin: holds token id \d+, outside the model's vocabulary of 100"):
        build_sft_datasets(sft_prefix, "90,10,0", 48, 30, 5, seed=0, vocab_size=100)
    # a mask written by another preprocess run is refused
    other = write_jsonl(tmp_path / "other.jsonl", animal_conversations(299))
    other_summary = preprocess_conversations(other, str(tmp_path / "other"), tokenizer_dir, progress=False)
    other_prefix = other_summary["outputs"]["tokens"]
    with pytest.raises(DataError, match="does not match"):
        SFTDataset(IndexedDataset(sft_prefix), IndexedDataset(mask_prefix(other_prefix)), np.arange(10), 48, 4, seed=0)


def run_sft_training(workdir, prefix, steps, micro_batch_size, name, extra=()):
    config = workdir / "tiny.yaml"
    config.write_text("model: llama-test\nmodel_overrides:\n  vocab_size: 512\n")  # the tokenizer has 400 ids
    metrics = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "llamatron",
        "train",
        "--config",
        str(config),
        "--sft-data",
        prefix,
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--seq-length",
        "96",
        "--micro-batch-size",
        str(micro_batch_size),
        "--global-batch-size",
        "8",
        "--train-steps",
        str(steps),
        "--lr",
        "3e-3",
        "--lr-schedule",
        "constant",
        "--no-progress",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--metrics-file",
        str(metrics),
        *extra,
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=workdir, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["loss"] for r in records if r.get("split") is None], done.stdout


def test_sft_training_loss_falls_and_is_a_global_token_mean(sft_prefix, tmp_path):
    losses, stdout = run_sft_training(tmp_path, sft_prefix, steps=30, micro_batch_size=2, name="mbs2")
    assert "sft data" in stdout and "truncated" in stdout and "packed into" in stdout
    size = IndexedDataset(sft_prefix)  # the data line gives the dataset's size and the samples drawn (8 x 30)
    assert f"{len(size):,} conversations, {size.num_tokens:,} tokens (train split: " in stdout
    assert "; 240 samples drawn" in stdout
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
    # One micro-batch of 8 must give the same losses as four of 2: the loss is the mean over the
    # trained tokens of the whole global batch, and the micro-batches hold different numbers of them.
    whole, _ = run_sft_training(tmp_path, sft_prefix, steps=4, micro_batch_size=8, name="mbs8")
    np.testing.assert_allclose(whole, losses[:4], rtol=1e-5)
    train, _ = build_sft_datasets(sft_prefix, "98,2,0", 96, 30 * 8, 8, seed=1234)
    per_micro_batch = [
        int((collate([train[i] for i in range(j, j + 2)])["labels"] != IGNORE_INDEX).sum()) for j in range(0, 8, 2)
    ]
    assert len(set(per_micro_batch)) > 1, per_micro_batch  # else a mean of means would agree too


def long_prompt_records(count):
    """Prompts far longer than 65 tokens, so truncation cuts every reply off."""
    return [
        {"prompt": "Please summarise this text: " + "lorem ipsum dolor sit amet " * 40, "response": "summary i"}
        for _ in range(count)
    ]


def test_conversations_that_lose_every_trained_token_are_counted_and_warned(sft_prefix, tokenizer_dir, tmp_path):
    records = [{"messages": m["messages"]} for m in animal_conversations(30)]
    records += [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]}
        for r in long_prompt_records(10)
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    prefix = preprocess_conversations(path, str(tmp_path / "mixed"), tokenizer_dir, progress=False)["outputs"]["tokens"]
    tokens, mask = IndexedDataset(prefix), IndexedDataset(mask_prefix(prefix))
    dataset = SFTDataset(tokens, mask, np.arange(len(tokens)), 64, 8, seed=0)
    assert dataset.untrained == 10 and dataset.truncated >= 10
    warning = dataset.warning()
    assert "10 of the 40 conversations of the train split lose all their trained (assistant) tokens" in warning
    assert f"the longest conversation has {int(tokens.sizes.max())} tokens" in warning and "--seq-length" in warning
    assert SFTDataset(tokens, mask, np.arange(30), 64, 8, seed=0).warning() is None  # only the short ones
    with pytest.raises(
        DataError,
        match=r"10 of the 10 conversations of the train split lose all their trained .*"
        r"no sample has a token to train on; raise --seq-length",
    ):
        SFTDataset(tokens, mask, np.arange(30, 40), 64, 8, seed=0)
    assert SFTDataset(tokens, mask, np.arange(30, 40), 1100, 8, seed=0).untrained == 0  # long enough: all trained


def test_train_refuses_sft_data_truncated_to_nothing(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", long_prompt_records(40))
    prefix = preprocess_conversations(
        path, str(tmp_path / "long"), tokenizer_dir, prompt_key="prompt", response_key="response", progress=False
    )["outputs"]["tokens"]
    config = tmp_path / "tiny.yaml"
    config.write_text("model: llama-test\nmodel_overrides:\n  vocab_size: 512\n")
    for pack in ("--pack", "--no-pack"):
        cmd = [
            sys.executable,
            "-m",
            "llamatron",
            "train",
            "--config",
            str(config),
            "--sft-data",
            prefix,
            pack,
            "--device",
            "cpu",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-steps",
            "3",
            "--no-progress",
        ]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert "llamatron train: data error: --sft-data" in done.stderr and "Traceback" not in done.stderr
        assert "39 of the 39 conversations of the train split lose all their trained" in done.stderr
        assert "raise --seq-length" in done.stderr and "loss" not in done.stdout


def test_sft_data_prefix_mistakes_get_a_hint(sft_prefix, tokenizer_dir, tmp_path, capsys):
    from llamatron.cli import main
    from llamatron.data.preprocess import preprocess

    output_prefix = sft_prefix[: -len("_sft")]  # what was given to preprocess --output-prefix
    with pytest.raises(DataError, match=rf"animals\.idx: file not found .*did you mean '{sft_prefix}'\?"):
        build_sft_datasets(output_prefix, "98,2,0", 48, 8, 8, seed=0)
    with pytest.raises(
        DataError,
        match=rf"--sft-data {sft_prefix}_mask is the loss mask of {sft_prefix}; give the "
        rf"token dataset, --sft-data {sft_prefix} ",
    ):
        build_sft_datasets(mask_prefix(sft_prefix), "98,2,0", 48, 8, 8, seed=0)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "plain text"}] * 4)
    pretraining = preprocess(text, str(tmp_path / "pt"), tokenizer_dir, progress=False)["outputs"]["text"]
    with pytest.raises(
        DataError,
        match=r"pt_text_document_mask\.idx: file not found.*--sft-data needs the loss "
        r"mask .* is .*pt_text_document a --data \(pre-training\) dataset\?",
    ):
        build_sft_datasets(pretraining, "98,2,0", 48, 8, 8, seed=0)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "llama-test", "--sft-data", output_prefix, "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"data error: {output_prefix}.idx: file not found" in err
    assert f"did you mean '{sft_prefix}'?" in err, err


# --- Llama 3's chat format, the generation prompt, missing markers ---


def llama3_text(messages):
    turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
    return "<|begin_of_text|>" + turns


@pytest.fixture(scope="module")
def llama3_tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3_sft_tokenizer")
    write_tiktoken_model(directory)
    return str(directory)


def test_llama3_format_for_meta_llama3_tokenizer(llama3_tokenizer_dir):
    encoder = ConversationEncoder(llama3_tokenizer_dir)
    assert encoder.renderer.format == "llama3" and encoder.renderer.missing_markers == []
    [(tokens, mask)] = encoder.encode([{"messages": CONVERSATION}])
    tok = encoder.tokenizer
    assert tok.decode(tokens) == llama3_text(CONVERSATION)
    special = tok.special_tokens
    assert tokens[0] == special["<|begin_of_text|>"]  # each marker is its one special token
    for marker in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert int((tokens == special[marker]).sum()) == len(CONVERSATION), marker
    assert [tok.decode(run) for run in trained_runs(tokens, mask)] == ["Blue.<|eot_id|>", "Green, obviously.<|eot_id|>"]


def test_llama3_format_for_a_hugging_face_llama3_tokenizer_without_template(llama3_tokenizer_dir, tmp_path):
    pytest.importorskip("transformers")
    from llamatron.interop.hf_tokenizer import hf_tokenizer_files

    files = hf_tokenizer_files(load_tokenizer(llama3_tokenizer_dir))  # what export-hf ships, less its template
    config = json.loads(files["tokenizer_config.json"])
    del config["chat_template"]
    (tmp_path / "tokenizer.json").write_text(files["tokenizer.json"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    encoder = ConversationEncoder(str(tmp_path))
    assert encoder.tokenizer.kind == "huggingface" and encoder.renderer.format == "llama3"
    [(tokens, mask)] = encoder.encode([{"messages": CONVERSATION}])
    [(expected_tokens, expected_mask)] = ConversationEncoder(llama3_tokenizer_dir).encode([{"messages": CONVERSATION}])
    assert tokens.tolist() == expected_tokens.tolist() and mask.tolist() == expected_mask.tolist()


def test_generation_prompt_and_end_of_turn(llama3_tokenizer_dir, tokenizer_dir, template_tokenizer_dir, tmp_path):
    question = CONVERSATION[:2]
    llama3 = ChatRenderer(llama3_tokenizer_dir)
    assert llama3.prompt(question) == llama3_text(question) + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    answered = "".join(text for text, _ in llama3.segments(CONVERSATION[:3]))
    assert answered == llama3.prompt(question) + "Blue.<|eot_id|>"  # the reply continues the prompt
    eot = load_tokenizer(llama3_tokenizer_dir).special_tokens["<|eot_id|>"]
    assert (llama3.end_of_turn, llama3.end_of_turn_id) == ("<|eot_id|>", eot)
    chatml = ChatRenderer(tokenizer_dir)
    assert chatml.prompt(question) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = load_tokenizer(tokenizer_dir).encode("<|im_end|>")
    assert chatml.end_of_turn == "<|im_end|>" and chatml.end_of_turn_id == (ids[0] if len(ids) == 1 else None)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(template_tokenizer_dir)
    template = ChatRenderer(template_tokenizer_dir)
    assert template.prompt(question) == hf.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert template.end_of_turn == hf.eos_token and template.end_of_turn_id == hf.eos_token_id
    # a template with a generation prompt (ChatML's, as chat_template writes it) ends the prompt with it
    chatml_template = tmp_path / "chatml_template"
    shutil.copytree(template_tokenizer_dir, chatml_template)
    config = json.loads((chatml_template / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template(CHATML)
    (chatml_template / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatRenderer(str(chatml_template)).prompt(question) == chatml.prompt(question)


def test_chatml_markers_that_are_no_special_tokens_are_warned_once(tmp_path, capsys):
    plain = tmp_path / "plain"
    train_bpe_tokenizer(["Say llama 3 times. llama llama llama. Answer about animals."] * 20, 300, str(plain))
    path = write_jsonl(tmp_path / "chat.jsonl", animal_conversations(6))
    assert ChatRenderer(str(plain)).missing_markers == ["<|im_start|>", "<|im_end|>"]
    preprocess_conversations(path, str(tmp_path / "plain_out"), str(plain), progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert "no special tokens for chatml's <|im_start|>, <|im_end|>: they are split into ordinary tokens" in warnings[0]
    assert "chat template" in warnings[0]  # how to avoid it
    marked = tmp_path / "marked"  # the same tokenizer with the markers as special tokens: nothing to warn about
    backend = tokenizers.Tokenizer.from_file(str(plain / "tokenizer.json"))
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    marked.mkdir()
    backend.save(str(marked / "tokenizer.json"))
    shutil.copy(plain / "tokenizer_config.json", marked)
    summary = preprocess_conversations(path, str(tmp_path / "marked_out"), str(marked), progress=False)
    assert "warning" not in capsys.readouterr().err and summary["chat_format"] == "chatml"
    tokens = IndexedDataset(summary["outputs"]["tokens"])
    assert int((tokens[0] == backend.token_to_id("<|im_end|>")).sum()) == len(animal_conversations(6)[0]["messages"])


def test_records_without_messages_name_the_prompt_and_response_flags(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"instruction": "Name a colour.", "output": "Blue."}])
    with pytest.raises(BadInputError, match=r"pairs\.jsonl:1: missing key 'messages' .*--prompt-key/--response-key"):
        preprocess_conversations(path, str(tmp_path / "out"), tokenizer_dir, progress=False)


def test_preprocess_help_documents_the_chat_formats():
    text = " ".join(add_preprocess_arguments(argparse.ArgumentParser()).format_help().split())
    for fragment in (
        "chat template",
        "Llama 3's format",
        "<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>",
        "ChatML",
        "<|im_start|>ROLE\\nCONTENT<|im_end|>\\n",
    ):
        assert fragment in text, fragment


def test_chat_prompt_and_end_of_turn(tokenizer_dir, template_tokenizer_dir):
    """What `generate --chat` continues and where it stops: ChatML's, and a chat template's (through transformers)."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    chatml = ChatRenderer(tokenizer_dir)
    assert chatml.prompt(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chatml.end_of_turn == "<|im_end|>"
    pytest.importorskip("transformers")
    template = ChatRenderer(template_tokenizer_dir)
    assert template.prompt(messages) == "<<SYS>> You are terse. <</SYS>> [INST] Name a colour. [/INST]"
    assert template.end_of_turn == load_tokenizer(template_tokenizer_dir).eod_token  # the template's eos_token


def test_an_sft_model_exports_with_its_chat_format_and_stops_at_its_end_of_turn(tokenizer_dir, tmp_path):
    """After ChatML fine-tuning on a tokenizer without a chat template, export-hf ships ChatML as the template
    (transformers' apply_chat_template writes the text trained on) and <|im_end|> among the eos ids; a model
    never fine-tuned on conversations gets neither (issue 39)."""
    transformers = pytest.importorskip("transformers")
    marked = tmp_path / "marked"  # the test tokenizer with ChatML's markers as special tokens
    backend = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    marked.mkdir()
    backend.save(str(marked / "tokenizer.json"))
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer_config.json"), marked)
    data = write_jsonl(tmp_path / "chat.jsonl", animal_conversations(40))
    prefix = preprocess_conversations(data, str(tmp_path / "chat"), str(marked), progress=False)["outputs"]["tokens"]
    run_sft_training(tmp_path, prefix, steps=2, micro_batch_size=2, name="sft", extra=["--save", "ck"])
    out = tmp_path / "hf"
    cli = [sys.executable, "-m", "llamatron", "export-hf", "ck", str(out), "--tokenizer", str(marked)]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "Name a cat."}, {"role": "assistant", "content": "Tom."}]
    assert hf_tokenizer.apply_chat_template(chat, tokenize=False) == (  # ChatML, written out
        "<|im_start|>user\nName a cat.<|im_end|>\n<|im_start|>assistant\nTom.<|im_end|>\n"
    )
    assert hf_tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert backend.token_to_id("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    # the same run's weights, but trained on plain text: exported as they were, without a chat format
    meta_file = tmp_path / "ck" / "step-2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("chat_tuned")
    meta_file.write_text(json.dumps(meta))
    plain = subprocess.run(
        [*cli[:-3], str(tmp_path / "plain"), *cli[-2:]], capture_output=True, text=True, cwd=tmp_path
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not transformers.AutoTokenizer.from_pretrained(tmp_path / "plain").chat_template
    generation = tmp_path / "plain" / "generation_config.json"
    plain_eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    assert backend.token_to_id("<|im_end|>") not in (plain_eos if isinstance(plain_eos, list) else [plain_eos])


def test_lora_fine_tunes_on_conversations_of_a_chat_template(template_tokenizer_dir, tmp_path):
    """SFT with LoRA: conversations rendered by the tokenizer's chat template, adapters trained from a base
    checkpoint; the loss falls, the saves hold the adapters and name the base, and stay marked as chat-tuned (so
    export-hf ships the chat format)."""
    data = write_jsonl(tmp_path / "chat.jsonl", animal_conversations(200))
    made = preprocess_conversations(data, str(tmp_path / "chat"), template_tokenizer_dir, progress=False)
    assert made["chat_format"] == "chat template"
    prefix = made["outputs"]["tokens"]
    run_sft_training(tmp_path, prefix, steps=1, micro_batch_size=2, name="base", extra=["--save", "base"])
    lora = ["--load", "base", "--finetune", "--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--save", "lora"]
    losses, _ = run_sft_training(tmp_path, prefix, steps=60, micro_batch_size=2, name="lora", extra=lora)
    # adapters of rank 8 on a 64-wide model move it slowly, but steadily: ~0.6 nats in 60 steps
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 0.3, losses
    meta = json.loads((tmp_path / "lora" / "step-60" / "meta.json").read_text())
    assert meta["chat_tuned"] and meta["base_checkpoint"]["path"].endswith("base/step-1")
    index = json.loads((tmp_path / "lora" / "step-60" / "index.json").read_text())
    assert {name.rsplit(".", 1)[-1] for name in index["tensors"]["model"]} == {"lora_a", "lora_b"}

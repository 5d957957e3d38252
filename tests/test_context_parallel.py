"""Context parallelism (--cp): each layout against the single-process run (per-step loss and grad norm, fp32,
gloo), and the pieces it is built from: the load-balanced split and attention of a rank's queries to the whole
sequence's keys."""

import json
from pathlib import Path

import pytest
import torch
from layout import assert_matches, run_train

from llamatron.config.settings import config_from_values
from llamatron.errors import ConfigError
from llamatron.models.attention import attention_core, attention_mask, load_balanced_index
from llamatron.parallel.context import split_for_context
from llamatron.training.validate import validate

CPU = torch.device("cpu")
FAST = ["--train-steps", "4"]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balanced_split_covers_every_token_once_and_evens_the_causal_work(cp):
    seq = 24 * cp
    parts = [load_balanced_index(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    work = [int((p + 1).sum()) for p in parts]  # keys a causal query at index i sees: i + 1
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("flex", [False, True])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU, on purpose
def test_a_ranks_queries_against_the_whole_sequence_match_full_attention(window, documents, flex):
    """What every cp layer computes: rank r's queries, the whole sequence's keys, the mask of r's positions;
    GQA (4 query heads, 2 KV heads). Together the ranks give full attention, row for row."""
    torch.manual_seed(0)
    seq, cp = 48, 3
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    docs = torch.tensor([[0] * 11 + [1] * 30 + [2] * 7, [0] * 48]) if documents else None
    full = attention_core(q, k, v, attention_mask(seq, window, docs, CPU, flex=False))
    for rank in range(cp):
        index = load_balanced_index(seq, cp, rank)
        mask = attention_mask(seq // cp, window, docs, CPU, context=(cp, rank), flex=flex)
        part = attention_core(q[:, :, index], k, v, mask)
        torch.testing.assert_close(part, full[:, :, index], rtol=1e-5, atol=1e-5)


def test_split_keeps_positions_global_and_document_ids_whole():
    mb = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "labels": torch.arange(16).reshape(2, 8) + 100,
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 2),
    }
    part = split_for_context(mb, 2, 1)  # chunks 1 and 2 of 4
    assert part["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert torch.equal(part["document_ids"], mb["document_ids"])
    assert split_for_context(mb, 1, 0) is mb


@pytest.mark.parametrize(
    "values, world, message",
    [
        ({"cp": 2, "seq_length": 30}, 2, r"--seq-length 30 must be divisible by 2\*cp = 4"),
        ({"cp": 2}, 3, r"world size 3 is not divisible by tp\*cp\*pp = 1\*2\*1"),
        ({"cp": 0}, 1, "--cp 0 must be >= 1"),
        (
            {"cp": 2, "tp": 4, "sequence_parallel": True, "seq_length": 20},
            8,
            r"--seq-length 20 / cp = 10 tokens per context-parallel rank must be divisible by tp=4",
        ),
    ],
)
def test_layouts_that_cannot_split_the_sequence_are_refused(values, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_from_values({"model": "llama-test", **values}), world)


_REFERENCES: dict[tuple, list[dict]] = {}


def _reference(workdir: Path, model: str = "llama-test", args: tuple[str, ...] = ()) -> list[dict]:
    key = (model, args)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_train([*FAST, *args], 1, workdir, model=model)
    return _REFERENCES[key]


@pytest.mark.parametrize(
    "args, nproc",
    [
        (["--cp", "2"], 2),
        (["--cp", "4"], 4),
        (["--cp", "2", "--tp", "2", "--sequence-parallel"], 4),
        (["--cp", "2", "--pp", "2"], 4),
        (["--cp", "2", "--distributed-optimizer", "--recompute", "selective"], 4),  # dp 2
        (["--cp", "2", "--recompute", "full"], 2),
    ],
    ids=["cp2", "cp4", "cp2-tp2-sp", "cp2-pp2", "cp2-dp2-distopt-selective", "cp2-full-recompute"],
)
def test_cp_layout_matches_single_process(args, nproc, tmp_path_factory):
    reference = _reference(tmp_path_factory.mktemp("ref"))
    assert_matches(reference, run_train([*FAST, *args], nproc, tmp_path_factory.mktemp("cp")))


def test_cp2_tp2_with_one_kv_head_matches_single_process(tmp_path_factory):
    """llama3-test has one KV head: fewer than cp x tp, so K/V are replicated over tp and gathered over cp."""
    reference = _reference(tmp_path_factory.mktemp("ref"), model="llama3-test")
    got = run_train([*FAST, "--cp", "2", "--tp", "2"], 4, tmp_path_factory.mktemp("cp"), model="llama3-test")
    assert_matches(reference, got)


@pytest.mark.parametrize("window", [4, 12])
def test_cp2_with_a_sliding_window_shorter_and_longer_than_a_chunk(window, tmp_path):
    """seq 32 at cp 2: chunks of 8 tokens; a window of 4 stays inside one, a window of 12 reaches the next."""
    config = tmp_path / "window.yaml"
    config.write_text(f"model: llama-test\nmodel_overrides:\n  sliding_window: {window}\n")
    reference = run_train([*FAST, "--config", str(config)], 1, tmp_path)
    assert_matches(reference, run_train([*FAST, "--config", str(config), "--cp", "2"], 2, tmp_path))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """A preprocessed corpus of short documents (3-40 tokens) and its tokenizer, for document masks."""
    from llamatron.data.preprocess import preprocess
    from llamatron.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    texts = [
        f"doc {i}: " + " ".join(["llama", "alpaca", "camel"][j % 3] for j in range(i % 13 + 1)) for i in range(300)
    ]
    train_bpe_tokenizer(texts, vocab_size=300, out_dir=str(root / "tok"))
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = preprocess(str(root / "docs.jsonl"), str(root / "docs"), str(root / "tok"), progress=False)["outputs"]
    return {"data": prefix["text"], "tokenizer": str(root / "tok")}


def test_cp2_with_document_masks_matches_single_process(corpus, tmp_path):
    config = tmp_path / "vocab.yaml"
    config.write_text("model: llama-test\nmodel_overrides:\n  vocab_size: 320\n")  # the tokenizer's 300 ids
    args = [*FAST, "--config", str(config), "--data", corpus["data"], "--tokenizer", corpus["tokenizer"]]
    args += ["--no-mock-data", "--reset-attention-mask"]
    args += ["--reset-position-ids", "--eod-mask-loss", "--seq-length", "64"]
    reference = run_train(args, 1, tmp_path)
    assert_matches(reference, run_train([*args, "--cp", "2"], 2, tmp_path))


def test_resume_across_cp_layouts_is_exact(tmp_path):
    """Saved at cp 2, resumed at cp 1 and at tp 2: both continue the uninterrupted run step for step."""
    steps = ["--train-steps", "5"]
    whole = run_train(["--cp", "2", "--save", "ck-cp2", "--save-interval", "2", *steps], 2, tmp_path)
    at_cp1 = run_train(["--load", "ck-cp2/step-2", *steps], 1, tmp_path)
    assert_matches(whole[2:], at_cp1)
    at_tp2 = run_train(["--tp", "2", "--load", "ck-cp2/step-2", *steps], 2, tmp_path)
    assert_matches(whole[2:], at_tp2)

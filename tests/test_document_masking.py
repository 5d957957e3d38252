"""Document boundaries: positions reset at EOD, attention confined to each document, EOD loss masked."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from llamatron.config.settings import ConfigError, RunConfig
from llamatron.data.batches import collate
from llamatron.data.boundaries import DocumentBoundaries, document_ids_and_positions
from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
from llamatron.models import IGNORE_INDEX, build_model, get_preset, materialize
from llamatron.models.attention import attention_core, attention_mask
from llamatron.training.validate import validate

CPU = torch.device("cpu")

EOD = 0


def test_document_ids_and_positions():
    tokens = np.array([5, 6, EOD, 7, 8, 9, EOD, EOD, 4])
    docs, positions = document_ids_and_positions(tokens, EOD)
    assert docs.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3]  # the EOD closes its own document
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0]
    docs, positions = document_ids_and_positions(np.array([3, 4, 5]), EOD)
    assert docs.tolist() == [0, 0, 0] and positions.tolist() == [0, 1, 2]


def test_boundaries_through_collate():
    samples = [np.array([5, 6, EOD, 7, 8, EOD, 9]), np.array([EOD, 1, 2, 3, 4, 5, 6])]
    each = DocumentBoundaries(samples, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    batch = collate([each[0], each[1]])
    assert batch["input_ids"].tolist() == [[5, 6, EOD, 7, 8, EOD], [EOD, 1, 2, 3, 4, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    ignore = IGNORE_INDEX
    assert batch["labels"].tolist() == [[6, ignore, 7, 8, ignore, 9], [1, 2, 3, 4, 5, 6]]
    only_positions = collate([DocumentBoundaries(samples, EOD, reset_position_ids=True)[0]])
    assert set(only_positions) == {"input_ids", "labels", "position_ids"}
    assert collate([DocumentBoundaries(samples, EOD)[0]])["labels"].tolist() == [[6, EOD, 7, 8, EOD, 9]]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU, on purpose
def test_flex_block_mask_matches_dense_mask(window):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    docs = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40])
    dense = attention_core(q, k, v, attention_mask(40, window, docs, CPU, flex=False))
    flex = attention_core(q, k, v, attention_mask(40, window, docs, CPU, flex=True))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    # each document alone gives the same result as the packed row
    alone = attention_core(q[:1, :, 7:27], k[:1, :, 7:27], v[:1, :, 7:27], attention_mask(20, window, None, CPU))
    torch.testing.assert_close(dense[:1, :, 7:27], alone, rtol=1e-5, atol=1e-5)
    whole = attention_core(q[1:], k[1:], v[1:], attention_mask(40, window, None, CPU))
    torch.testing.assert_close(dense[1:], whole, rtol=1e-5, atol=1e-5)


def tiny_model(preset):
    cfg = get_preset(preset)
    model = build_model(cfg)
    materialize(model, cfg, seed=0, device="cpu", dtype=torch.float32)
    return model.eval(), cfg


def packed_row(cfg, lengths, seed):
    """A row of documents of the given lengths, each ending with EOD, with its ids and positions."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, cfg.vocab_size, n - 1), EOD) for n in lengths]
    tokens = np.concatenate(docs)
    doc_ids, positions = document_ids_and_positions(tokens, EOD)
    return [torch.from_numpy(a)[None] for a in (tokens, doc_ids, positions)]


@pytest.mark.parametrize("preset", ["llama-test", "falcon-test", "mistral-test"])
@torch.no_grad()
def test_no_attention_across_documents(preset):
    model, cfg = tiny_model(preset)
    tokens, doc_ids, positions = packed_row(cfg, [11, 30, 9], seed=1)
    changed = tokens.clone()
    changed[0, :11] = torch.from_numpy(np.random.default_rng(7).integers(1, cfg.vocab_size, 11))  # rewrite document A
    b = slice(11, 41)  # document B

    isolated = model(tokens, position_ids=positions, document_ids=doc_ids)
    isolated_changed = model(changed, position_ids=positions, document_ids=doc_ids)
    torch.testing.assert_close(isolated_changed[:, b], isolated[:, b], rtol=0, atol=0)
    assert not torch.allclose(isolated_changed[:, :11], isolated[:, :11])
    # ...and B's logits are those of B alone, in a row of its own
    alone = model(tokens[:, b])
    torch.testing.assert_close(isolated[:, b], alone, rtol=1e-5, atol=1e-5)

    # without the flag, document A leaks into B (so the check above can fail)
    leaky = model(tokens, position_ids=positions)
    assert not torch.allclose(model(changed, position_ids=positions)[:, b], leaky[:, b])


def test_config_validation_of_boundary_flags():
    def check(**data):
        cfg = RunConfig()
        for key, value in data.items():
            setattr(cfg.data, key, value)
        return validate(cfg)

    check(data="prefix", tokenizer="tok", reset_attention_mask=True)
    with pytest.raises(ConfigError, match="--reset-attention-mask need the end-of-document token id: pass --tokenizer"):
        check(data="prefix", reset_attention_mask=True)
    with pytest.raises(ConfigError, match="--mock-data has none"):
        check(mock_data=True, eod_mask_loss=True)
    with pytest.raises(ConfigError, match="--sft-data replaces --data"):
        check(data="prefix", sft_data="sft")


def test_training_with_document_boundaries(tmp_path):
    """`llamatron train` with the three flags on a preprocessed corpus: the samples carry them and it learns."""
    from llamatron.data.preprocess import preprocess
    from llamatron.data.tokenizer import train_bpe_tokenizer

    texts = [
        f"document {i}: " + " ".join(["llama", "alpaca", "camel"][j % 3] for j in range(i % 17 + 3)) for i in range(300)
    ]
    train_bpe_tokenizer(texts, vocab_size=300, out_dir=str(tmp_path / "tok"))
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = preprocess(str(tmp_path / "docs.jsonl"), str(tmp_path / "docs"), str(tmp_path / "tok"), progress=False)[
        "outputs"
    ]["text"]
    (tmp_path / "tiny.yaml").write_text("model: llama-test\nmodel_overrides:\n  vocab_size: 320\n")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "llamatron",
        "train",
        "--config",
        str(tmp_path / "tiny.yaml"),
        "--data",
        prefix,
        "--tokenizer",
        str(tmp_path / "tok"),
        "--reset-position-ids",
        "--reset-attention-mask",
        "--eod-mask-loss",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--seq-length",
        "64",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-steps",
        "12",
        "--lr",
        "3e-3",
        "--no-progress",
        "--eval-iters",
        "1",
        "--metrics-file",
        str(metrics),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if "split" not in line]
    assert len(losses) == 12 and losses[-1] < losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_attention_on_cuda():
    """On CUDA the model takes the flex-attention path: same numbers as the dense mask, gradients flow
    (also under selective recompute and per-layer compile), and new document layouts reuse the kernels."""
    from torch._dynamo.utils import counters

    from llamatron.training.engine import apply_compile, apply_recompute

    torch.manual_seed(0)
    dev = torch.device("cuda")
    q, k, v = (torch.randn(2, h, 256, 64, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2))
    docs = torch.tensor([[0] * 100 + [1] * 156, [0] * 30 + [1] * 200 + [2] * 26], device=dev)
    for window in (None, 64):
        flex_mask = attention_mask(256, window, docs, dev)
        assert flex_mask.block is not None and flex_mask.dense is None  # a BlockMask on CUDA
        flex = attention_core(q, k, v, flex_mask)
        dense = attention_core(q, k, v, attention_mask(256, window, docs, dev, flex=False))
        torch.testing.assert_close(flex, dense, rtol=2e-2, atol=2e-2)

    cfg = get_preset("llama-test")
    model = build_model(cfg)
    materialize(model, cfg, seed=0, device=dev, dtype=torch.float32)
    tokens, doc_ids, positions = (t.to(dev) for t in packed_row(cfg, [64, 100, 92], seed=3))
    with torch.no_grad():
        packed = model(tokens, position_ids=positions, document_ids=doc_ids)
        alone = model(tokens[:, 64:164])
    torch.testing.assert_close(packed[:, 64:164], alone, rtol=1e-3, atol=1e-3)

    apply_recompute(model, "selective", None)
    apply_compile(model)
    logits = model(tokens, position_ids=positions, document_ids=doc_ids)
    cross_entropy_per_token(logits, tokens).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        compiled = model(tokens, position_ids=positions, document_ids=doc_ids)
    torch.testing.assert_close(compiled, packed, rtol=1e-3, atol=1e-3)
    graphs = counters["stats"]["unique_graphs"]
    other_ids, other_positions = (t.to(dev) for t in packed_row(cfg, [128, 20, 108], seed=4)[1:])
    with torch.no_grad():
        model(tokens, position_ids=other_positions, document_ids=other_ids)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for new document ids

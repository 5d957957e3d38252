"""A Llama 3 user's whole path on a tiny model (issue 23): Meta's 3.1 weights and tiktoken tokenizer.model ->
import-hf -> preprocess --sft in Llama 3's chat format -> fine-tune -> generate --chat with the KV cache, stopping
at <|eot_id|> -> export-hf -> transformers loads the weights and the tokenizer and agrees."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import make_random_model, write_meta_consolidated
from test_meta_llama import LLAMA31, LLAMA31_PARAMS
from tiktoken_fixtures import write_tiktoken_model

from llamatron.cli import main
from llamatron.commands import generate
from llamatron.data.tokenizer import load_tokenizer
from llamatron.inference.generate import load_for_generation

transformers = pytest.importorskip("transformers")  # in the test extra; the path ends in transformers
RANKS = 360
VOCAB = RANKS + 256  # the ranks, then Llama 3's 256 special tokens
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    [{"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green, obviously."}],
] * 8


def run(*args) -> None:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in args])
    assert done.value.code == 0, args


def test_a_llama3_user_goes_from_meta_files_to_transformers(tmp_path, monkeypatch):
    meta = tmp_path / "meta"
    original = make_random_model("Llama", dict(LLAMA31, vocab_size=VOCAB))
    write_meta_consolidated(original, meta, {**LLAMA31_PARAMS, "vocab_size": VOCAB}, embed_split=0)
    write_tiktoken_model(meta, RANKS)
    run("import-hf", meta, tmp_path / "imported")
    tok = load_tokenizer(str(meta))
    eot = tok.encode("<|eot_id|>")
    assert len(eot) == 1

    # SFT data in Llama 3's format, the loss on the assistant replies and their <|eot_id|>
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS)
    run("preprocess", "--sft", "--input", tmp_path / "chats.jsonl", "--output-prefix", tmp_path / "chats",
        "--tokenizer", meta)  # fmt: skip
    from llamatron.data.indexed import IndexedDataset

    first = IndexedDataset(str(tmp_path / "chats_sft")).get(0).tolist()
    mask = IndexedDataset(str(tmp_path / "chats_sft_mask")).get(0).tolist()
    text = tok.decode(first)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>")
    assert tok.decode([t for t, m in zip(first, mask) if m]) == "Blue.<|eot_id|>"

    run("train", "--load", tmp_path / "imported", "--finetune", "--sft-data", tmp_path / "chats_sft",
        "--tokenizer", meta, "--device", "cpu", "--precision", "fp32", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-steps", "3", "--eval-iters", "1", "--no-progress",
        "--save", tmp_path / "tuned")  # fmt: skip

    # generate --chat: Llama 3's prompt, the KV cache, a stop at <|eot_id|>
    seen = {}
    real_generate = generate.generate_batch

    def spy(model, prompts, *args, **kwargs):
        seen.update(prompt=prompts[0], **kwargs)
        return real_generate(model, prompts, *args, **kwargs)

    monkeypatch.setattr(generate, "generate_batch", spy)
    run("generate", "--load", tmp_path / "tuned", "--chat", "--prompt", "Name a colour.", "--max-new-tokens", "8",
        "--temperature", "0", "--device", "cpu")  # fmt: skip
    assert tok.decode(seen["prompt"]).endswith(
        "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert eot[0] in seen["stop_ids"]

    # export-hf: transformers loads the weights and the tokenizer, and both agree with llamatron's
    run("export-hf", tmp_path / "tuned", tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sample_text = "Name a colour.<|eot_id|> Ünïcödé 🦙"
    assert hf_tok.encode(sample_text, add_special_tokens=False) == tok.encode(sample_text)
    ours, _ = load_for_generation(str(tmp_path / "tuned"))
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        assert (ours(ids) - hf_model(ids).logits).abs().max() <= 1e-4
    assert hf_model.config.rope_scaling["rope_type"] == "llama3"
    generation = json.loads((tmp_path / "hf/generation_config.json").read_text())
    assert eot[0] in generation["eos_token_id"]  # transformers' generate stops a reply at <|eot_id|> too

"""DPO (`--objective dpo`) against TRL's DPOTrainer on the same tiny model and pairs (fp32): the first step's loss,
gradient norm and logged statistics, from `preprocess --preference` through `llamatron train`.

Two ways to a reference: the run's own (the starting weights, here LoRA adapters read with --lora-init-from, which
TRL copies into its reference adapter), and a reference table changed on disk (the run reads the cached table;
TRL is given the same numbers as precomputed reference log-probs), where the policy and reference differ so the
loss, rewards and accuracy are not their values at a tie."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from test_train import llamatron

from llamatron.data.preference_dataset import build_preference_datasets
from llamatron.data.tokenizer import train_bpe_tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ANIMALS = ["llama", "alpaca", "camel", "vicuna", "guanaco", "dromedary"]
SEQ, GLOBAL, MICRO = 96, 8, 2
STATS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected")
TRL_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def animal_pairs(count: int, seed: int = 0) -> list[dict]:
    """The chosen reply says the asked animal the asked number of times; the rejected one another animal."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        a, b = rng.choice(len(ANIMALS), 2, replace=False)
        times = int(rng.integers(1, 4))
        prompt = f"Say {ANIMALS[a]} {times} times."
        out.append(
            {
                "prompt": prompt if i % 2 else [{"role": "user", "content": prompt}],
                "chosen": " ".join([ANIMALS[a]] * times) + ".",
                "rejected": " ".join([ANIMALS[b]] * (times + i % 2)) + ".",
            }
        )
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tokenizer, a random Hugging Face Llama imported as the base checkpoint, a PEFT adapter with non-zero B
    (PEFT's init_lora_weights=False), and preference pairs preprocessed with the tokenizer."""
    d = tmp_path_factory.mktemp("dpo")
    records = animal_pairs(40)
    (d / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    train_bpe_tokenizer([json.dumps(r) for r in records] * 3, vocab_size=320, out_dir=str(d / "tok"))
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(d / "hf")
    for f in (d / "tok").iterdir():
        shutil.copy(f, d / "hf")
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(d / "hf"), lora).save_pretrained(d / "adapter")
    llamatron("import-hf", str(d / "hf"), str(d / "base"), cwd=d)
    llamatron(
        "preprocess", "--input", "pairs.jsonl", "--output-prefix", "data/p", "--tokenizer", "tok", "--preference", cwd=d
    )
    return d


RUN = ["--objective", "dpo", "--preference-data", "data/p_pref", "--seq-length", str(SEQ), "--split", "100,0,0"]
RUN += ["--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-steps", "1", "--lr", "1e-3"]
RUN += ["--device", "cpu", "--precision", "fp32", "--no-progress", "--eval-interval", "0", "--log-interval", "1"]


def first_step(world, tmp_path, *flags: str) -> dict:
    metrics = tmp_path / f"m{len(list(tmp_path.glob('m*.jsonl')))}.jsonl"
    llamatron(
        "train", "--load", str(world / "base"), "--finetune", *RUN, *flags, "--metrics-file", str(metrics), cwd=world
    )
    return json.loads(metrics.read_text().splitlines()[0])


def trl_examples(world) -> list[dict]:
    """The first step's pairs (the run's data order), as TRL's tokenized examples: the prompt, and each response's
    trained tokens (the sequence's untrained end, ChatML's newline after the turn, predicts nothing)."""
    train, _ = build_preference_datasets(str(world / "data/p_pref"), "100,0,0", SEQ, GLOBAL, 0, 1234)
    out = []
    for j in range(GLOBAL // 2):
        chosen, rejected = train[2 * j], train[2 * j + 1]
        spans = [np.flatnonzero(s["loss_mask"]) for s in (chosen, rejected)]
        start = int(spans[0][0])
        assert start == spans[1][0] and (chosen["tokens"][:start] == rejected["tokens"][:start]).all()
        out.append(
            {
                "prompt_ids": chosen["tokens"][:start].tolist(),
                "chosen_ids": chosen["tokens"][start : spans[0][-1] + 1].tolist(),
                "rejected_ids": rejected["tokens"][start : spans[1][-1] + 1].tolist(),
            }
        )
    return out


def trl_first_step(world, model, kind: str, reference: np.ndarray | None = None) -> dict:
    """TRL's loss, gradient norm and statistics on the first step's pairs; `reference`: (pairs, 2) precomputed
    reference log-probs, else TRL's own reference (a PEFT model's initial adapter, copied)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(world / "tok/tokenizer.json"))
    tok.pad_token = tok.eos_token = "<|endoftext|>"
    args = DPOConfig(
        output_dir=str(world / "trl"),
        beta=0.1,
        loss_type=[kind],
        report_to="none",
        use_cpu=True,
        precompute_ref_log_probs=reference is not None,
    )
    dummy = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # TRL tokenizes it at init
    trainer = DPOTrainer(model=model.train(), args=args, train_dataset=dummy, processing_class=tok)
    examples = trl_examples(world)
    batch = trainer.data_collator(examples)
    if reference is not None:
        batch["ref_chosen_logps"] = torch.tensor(reference[:, 0], dtype=torch.float32)
        batch["ref_rejected_logps"] = torch.tensor(reference[:, 1], dtype=torch.float32)
    loss = trainer._compute_loss(trainer.model, batch, False)
    loss.backward()
    norm = sum(float(p.grad.double().pow(2).sum()) for p in trainer.model.parameters() if p.grad is not None) ** 0.5
    out = {"loss": float(loss.detach()), "grad_norm": norm}
    out.update({ours: trainer._metrics["train"][theirs][-1] for ours, theirs in zip(STATS, TRL_STATS)})
    return out


def assert_close(ours: dict, trl: dict) -> None:
    """Within 1e-5: relative for the loss, gradient norm and log-probabilities; absolute for the rewards, differences
    of log-probabilities near -70 (fp32 rounds those at ~4e-6) times beta; the accuracy exactly."""
    for key in ("loss", "grad_norm", "logps_chosen", "logps_rejected"):
        assert abs(ours[key] - trl[key]) <= 1e-5 * abs(trl[key]), (key, ours[key], trl[key])
    for key in ("rewards_chosen", "rewards_rejected", "rewards_margin"):
        assert abs(ours[key] - trl[key]) <= 1e-5, (key, ours[key], trl[key])
    assert ours["rewards_accuracy"] == trl["rewards_accuracy"]


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_first_step_from_a_peft_adapter_equals_trl(world, tmp_path, kind):
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,down", "--lora-init-from", "adapter"]
    ours = first_step(world, tmp_path, *lora, "--dpo-loss", kind, "--data-cache-path", str(tmp_path))
    base = transformers.LlamaForCausalLM.from_pretrained(world / "hf", dtype=torch.float32)
    policy = peft.PeftModel.from_pretrained(base, world / "adapter", is_trainable=True)
    assert_close(ours, trl_first_step(world, policy, kind))
    assert ours["rewards_margin"] == 0 and ours["grad_norm"] > 1e-3  # the reference is the starting model


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "sigmoid_norm"])
def test_loss_against_another_reference_equals_trl(world, tmp_path, kind):
    """Full fine-tuning; the cached reference table is replaced by shifted numbers before the run reads it."""
    cache = tmp_path / "cache"
    first_step(world, tmp_path, "--dpo-loss", kind, "--data-cache-path", str(cache))
    (table_file,) = cache.glob("*-reference-*.npy")
    table = np.load(table_file)
    shifted = table + np.random.default_rng(0).normal(0.0, 2.0, table.shape)
    np.save(table_file, shifted)
    ours = first_step(world, tmp_path, "--dpo-loss", kind, "--data-cache-path", str(cache))
    train, _ = build_preference_datasets(str(world / "data/p_pref"), "100,0,0", SEQ, GLOBAL, 0, 1234)
    reference = shifted[train.order[: GLOBAL // 2]]
    policy = transformers.LlamaForCausalLM.from_pretrained(world / "hf", dtype=torch.float32)
    trl = trl_first_step(world, policy, kind, reference)
    assert_close(ours, trl)
    assert 0 < ours["rewards_accuracy"] < 1 and abs(ours["rewards_margin"]) > 1e-2  # not a tie


def test_preprocess_trains_only_the_responses(world, tmp_path):
    """Each record format; the prompt's own assistant turn is context, never trained."""
    records = [
        {"prompt": "Say llama.", "chosen": "llama.", "rejected": "camel."},
        {
            "messages": [
                {"role": "user", "content": "Say camel."},
                {"role": "assistant", "content": "camel."},
                {"role": "user", "content": "Again?"},
            ],
            "chosen": [{"role": "assistant", "content": "camel camel."}],
            "rejected": [{"role": "assistant", "content": "alpaca."}],
        },
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    tok = str(world / "tok")
    llamatron(
        "preprocess", "--input", "r.jsonl", "--output-prefix", "o", "--tokenizer", tok, "--preference", cwd=tmp_path
    )
    from llamatron.data.preference_dataset import PreferencePairs
    from llamatron.data.tokenizer import load_tokenizer

    pairs, tokenizer = PreferencePairs(str(tmp_path / "o_pref")), load_tokenizer(tok)
    for i, record in enumerate(records):
        for r, key in enumerate(("chosen", "rejected")):
            tokens, mask = pairs.tokens[r][i], pairs.masks[r][i].astype(bool)
            reply = record[key] if isinstance(record[key], str) else record[key][0]["content"]
            assert tokenizer.decode(tokens[mask].tolist()) == reply + "<|im_end|>"
            assert reply in tokenizer.decode(tokens.tolist())
    assert "camel.<|im_end|>" in tokenizer.decode(pairs.tokens[0][1].tolist())  # the prompt's turn is kept


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "Hi", "chosen": "Hello."}, "missing key 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "missing key 'messages'"),
        ({"prompt": "Hi", "chosen": "", "rejected": "b"}, "key 'chosen' is empty"),
        ({"prompt": "Hi", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"}, "no assistant reply"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "must be a string or a non-empty list"),
        ({"prompt": [], "chosen": "a", "rejected": "b"}, "must be a non-empty list of messages"),
    ],
)
def test_a_bad_preference_record_is_one_line(world, tmp_path, record, message):
    (tmp_path / "r.jsonl").write_text(
        json.dumps({"prompt": "ok", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(record) + "\n"
    )
    args = [
        "preprocess",
        "--input",
        "r.jsonl",
        "--output-prefix",
        "o",
        "--tokenizer",
        str(world / "tok"),
        "--preference",
    ]
    proc = llamatron(*args, cwd=tmp_path, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and message in last and "r.jsonl:2" in last and "Traceback" not in proc.stderr, (
        proc.stderr
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        # (--objective dpo with no data at all is the DPO demo)
        (["--objective", "dpo", "--sft-data", "data/p_pref"], "--objective dpo needs --preference-data"),
        (
            [
                "--objective",
                "dpo",
                "--preference-data",
                "data/p_pref",
                "--micro-batch-size",
                "3",
                "--global-batch-size",
                "6",
            ],
            "must be even",
        ),
        (["--objective", "dpo", "--preference-data", "data/p_pref", "--mock-data"], "drop --mock-data"),
        (["--preference-data", "data/p_pref"], "is read by --objective dpo only"),
        (["--objective", "dpo", "--preference-data", "data/p_pref_chosen"], "give the prefix without _chosen"),
        (["--objective", "dpo", "--preference-data", "data/p_pref", "--dpo-beta", "0"], "dpo-beta"),
    ],
)
def test_bad_dpo_settings_are_one_line(world, tmp_path, flags, message):
    proc = llamatron(
        "train", "--model", "llama-test", "--device", "cpu", "--train-steps", "1", *flags, cwd=world, check=False
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bench_ignores_the_objective_and_times_the_language_model_step(tmp_path):
    flags = ["--model", "llama-test", "--device", "cpu", "--seq-length", "16", "--global-batch-size", "2"]
    flags += ["--micro-batch-size", "2", "--steps", "1", "--warmup", "0", "--objective", "dpo", "--dpo-beta", "0.5"]
    proc = llamatron("bench", *flags, "--json", cwd=tmp_path, check=False)
    assert proc.returncode == 0 and "ignoring --dpo-beta, --objective" in proc.stderr, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["data"] == "mock"

"""Small random transformers models of every family llamatron converts (shared by the Hugging Face tests)."""

from __future__ import annotations

import torch

VOCAB = 96
_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
_FALCON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=128,
    parallel_attn=True,
    alibi=False,
)

# name -> (transformers class name, config kwargs, sequence length of the equivalence check)
FAMILIES: dict[str, tuple[str, dict, int]] = {
    "llama": ("Llama", dict(_LLAMA, num_key_value_heads=4), 24),
    "llama2-gqa": ("Llama", dict(_LLAMA, num_key_value_heads=2), 24),
    "llama3-rope-scaling": (
        "Llama",
        dict(
            _LLAMA,
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        40,
    ),
    "codellama-theta": ("Llama", dict(_LLAMA, num_key_value_heads=2, rope_theta=1e6), 24),
    "llama-linear-scaling": ("Llama", dict(_LLAMA, rope_scaling={"rope_type": "linear", "factor": 4.0}), 24),
    # Dynamic NTK only changes anything past max_position_embeddings: run longer than that.
    "llama-dynamic-scaling": (
        "Llama",
        dict(_LLAMA, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        40,
    ),
    "llama-tied-bias": (
        "Llama",
        dict(_LLAMA, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        24,
    ),
    "mistral-window": ("Mistral", dict(_LLAMA, num_key_value_heads=2, sliding_window=8), 40),
    "falcon-7b-layout": (
        "Falcon",
        dict(_FALCON, num_attention_heads=4, multi_query=True, new_decoder_architecture=False),
        24,
    ),
    "falcon-40b-layout": (
        "Falcon",
        dict(_FALCON, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True),
        24,
    ),
    "falcon-mha-bias": (
        "Falcon",
        dict(_FALCON, num_attention_heads=4, multi_query=False, new_decoder_architecture=False, bias=True),
        24,
    ),
}


def make_hf_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random transformers causal LM; norms and biases get random values too, so a swapped one shows."""
    import transformers

    kind, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, f"{kind}Config")(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights/biases, linear biases
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model.to(dtype).eval()


def random_tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def train_with_bpe_tokenizer(workdir, ckpt_name: str = "ckpt"):
    """A llama-test checkpoint trained one step from scratch (mock data) that records a tokenizer made by
    train_bpe_tokenizer (`<|endoftext|>` is id 0, no BOS token); returns (checkpoint dir, tokenizer dir)."""
    from llamatron.data.tokenizer import train_bpe_tokenizer

    tok_dir = workdir / "tok"
    if not tok_dir.exists():
        train_bpe_tokenizer(["def f(x):\n    return x + 1\n" * 20], 300, str(tok_dir))
    return train_with_tokenizer(workdir, tok_dir, 320, ckpt_name), tok_dir  # room for the tokenizer's 300


def train_with_tokenizer(workdir, tok_dir, vocab_size: int, ckpt_name: str = "ckpt"):
    """A llama-test checkpoint (vocabulary `vocab_size`) trained one step from scratch on mock data that records
    the tokenizer `tok_dir`; returns the checkpoint directory."""
    from llamatron.cli import main

    config = workdir / f"{ckpt_name}.yaml"
    config.write_text(f"model: llama-test\nmodel_overrides: {{vocab_size: {vocab_size}}}\n")
    args = [
        "train",
        "--config",
        config,
        "--tokenizer",
        tok_dir,
        "--mock-data",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-steps",
        "1",
        "--no-progress",
        "--eval-iters",
        "1",
        "--save",
        workdir / ckpt_name,
    ]
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        assert not e.code, e.code
    return workdir / ckpt_name

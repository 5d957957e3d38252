"""Small random transformers models of every family llamatron converts (shared by the Hugging Face tests)."""

from __future__ import annotations

import json
from pathlib import Path

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
    # YaRN (models/yarn.py): past its trained 16 positions, the attention factor on cos and sin (mscale alone)
    "llama-yarn": (
        "Llama",
        dict(
            _LLAMA,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
            },
        ),
        40,
    ),
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
    # Qwen2.5: q/k/v biases, tied embeddings; Qwen3: q/k norms and a head_dim that is not hidden / heads
    "qwen2-tied": ("Qwen2", dict(_LLAMA, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6), 24),
    "qwen3": ("Qwen3", dict(_LLAMA, num_key_value_heads=2, head_dim=32, rope_theta=1e6), 24),
}

# Mixtral (tests/test_hf_mixtral.py): name -> (config kwargs, sequence length of the equivalence check). Apart
# from FAMILIES: the dense tests' parametrisations stay as they were.
MIXTRAL: dict[str, tuple[dict, int]] = {
    # the Hub's 8x7B in small: top-2 routing, GQA, Mixtral's aux coefficient; a window shorter than the sequence
    "mixtral": (
        dict(
            _LLAMA,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            sliding_window=8,
        ),
        40,
    ),
    "mixtral-top1-tied": (
        dict(
            _LLAMA,
            num_key_value_heads=1,
            num_local_experts=3,
            num_experts_per_tok=1,
            tie_word_embeddings=True,
            rope_theta=5e5,
        ),
        24,
    ),
}


def make_mixtral(variant: str = "mixtral", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random transformers MixtralForCausalLM (see make_hf_model)."""
    return make_random_model("Mixtral", MIXTRAL[variant][0], seed, dtype)


def mixtral_hub_state(model) -> dict[str, torch.Tensor]:
    """The Hub's tensor names (block_sparse_moe.gate, per-expert w1/w2/w3) of a transformers Mixtral, built by
    hand from its state dict: transformers 5 holds the experts stacked, gate_up_proj rows [w1 (gate); w3 (up)]."""
    out = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = t[e, :ffn].clone()
                out[f"{prefix}.{e}.w3.weight"] = t[e, ffn:].clone()
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = t[e].clone()
        else:  # transformers 4.x holds the Hub's names already
            out[name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t.clone()
    return out


def make_hf_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random transformers causal LM; norms and biases get random values too, so a swapped one shows."""
    kind, kwargs, _ = FAMILIES[family]
    return make_random_model(kind, kwargs, seed, dtype)


def make_random_model(kind: str, kwargs: dict, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random transformers `{kind}ForCausalLM` of config `kwargs` (see make_hf_model)."""
    import transformers

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


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's half-split rotary rows back to Meta's adjacent pairs (the inverse of the import)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


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


def train_with_tokenizer(workdir, tok_dir, vocab_size: int, ckpt_name: str = "ckpt", overrides: str = ""):
    """A llama-test checkpoint (vocabulary `vocab_size`; `overrides`: more model_overrides, e.g. ", max_seq_length:
    32") trained one step from scratch on mock data that records the tokenizer `tok_dir`; returns the checkpoint
    directory."""
    from llamatron.cli import main

    config = workdir / f"{ckpt_name}.yaml"
    config.write_text(f"model: llama-test\nmodel_overrides: {{vocab_size: {vocab_size}{overrides}}}\n")
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


# Meta's params.json of the small Llama 2 shape above: FFN 2/3 * 4 * 64 * 0.5 rounded up to 32 = 96
LLAMA2_PARAMS = {"multiple_of": 32, "ffn_dim_multiplier": 0.5, "vocab_size": -1}


def write_meta_consolidated(
    model, directory: Path, params: dict | None = None, shards: int = 2, embed_split: int = 1
) -> None:
    """Meta's layout: model-parallel slices (column-parallel by rows, row-parallel by columns; the embedding
    by columns in Llama 1/2, `embed_split` 0: by rows as Llama 3's VocabParallelEmbedding)."""
    sd, c = model.state_dict(), model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    tensors = {
        "tok_embeddings.weight": (sd["model.embed_tokens.weight"], embed_split),
        "norm.weight": (sd["model.norm.weight"], None),
        "output.weight": (sd["lm_head.weight"], 0),
    }
    for i in range(c.num_hidden_layers):
        h = f"model.layers.{i}"
        tensors.update(
            {
                f"layers.{i}.attention.wq.weight": (halves_to_pairs(sd[f"{h}.self_attn.q_proj.weight"], heads), 0),
                f"layers.{i}.attention.wk.weight": (halves_to_pairs(sd[f"{h}.self_attn.k_proj.weight"], kv), 0),
                f"layers.{i}.attention.wv.weight": (sd[f"{h}.self_attn.v_proj.weight"], 0),
                f"layers.{i}.attention.wo.weight": (sd[f"{h}.self_attn.o_proj.weight"], 1),
                f"layers.{i}.feed_forward.w1.weight": (sd[f"{h}.mlp.gate_proj.weight"], 0),
                f"layers.{i}.feed_forward.w3.weight": (sd[f"{h}.mlp.up_proj.weight"], 0),
                f"layers.{i}.feed_forward.w2.weight": (sd[f"{h}.mlp.down_proj.weight"], 1),
                f"layers.{i}.attention_norm.weight": (sd[f"{h}.input_layernorm.weight"], None),
                f"layers.{i}.ffn_norm.weight": (sd[f"{h}.post_attention_layernorm.weight"], None),
            }
        )
    directory.mkdir()
    for s in range(shards):
        torch.save(
            {n: (t if dim is None else t.chunk(shards, dim)[s]).clone() for n, (t, dim) in tensors.items()},
            directory / f"consolidated.{s:02d}.pth",
        )
    base = {"dim": c.hidden_size, "n_layers": c.num_hidden_layers, "n_heads": heads, "n_kv_heads": kv}
    params = LLAMA2_PARAMS if params is None else params
    (directory / "params.json").write_text(json.dumps({**base, "norm_eps": c.rms_norm_eps, **params}))


def rewrite_imported_weights(step_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Replace an import's model.safetensors with `state` as a consistent checkpoint of other weights: its meta.json
    records the new file's sha256 (import-hf's own record; a file changed without it is refused as corrupt)."""
    from safetensors.torch import save_file

    from llamatron.checkpoint.reader import file_sha256

    save_file(state, str(step_dir / "model.safetensors"))
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["checksums"] = {"model.safetensors": file_sha256(step_dir / "model.safetensors")}
    (step_dir / "meta.json").write_text(json.dumps(meta))

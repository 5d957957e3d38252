"""Megatron-LM checkpoints in the legacy layout, written from a transformers Llama with plain torch.save (tests).

Written from the layouts of Megatron's own code, not from llamatron's reader: per KV group [q heads; k; v]
rows of the fused QKV (Megatron-LLaMA: each tensor rank's [q; k; v]), each tensor rank's fc1 as [gate; up]
(Megatron-LLM: [up; gate]), q/k rows in the adjacent-pairs rotary layout for Megatron-LLM, a vocabulary padded
for tensor parallelism, layers numbered from 0 on each pipeline stage.
"""

from __future__ import annotations

import argparse
import enum
import io
import sys
import types
from pathlib import Path

import numpy as np
import torch
from hf_fixtures import FAMILIES, VOCAB, halves_to_pairs

PADDED = 128  # the vocabulary (hf_fixtures.VOCAB, 96) as Megatron pads it: a multiple of 64 (32 x tp 2)
# 4 layers: 2 per pipeline stage, 1 per virtual stage with vpp 2
LLAMA = dict(FAMILIES["llama"][1], num_hidden_layers=4, num_key_value_heads=2, rope_theta=500000.0)


def megatron_args(model, tp: int, pp: int, flavour: str, **extra) -> argparse.Namespace:
    c = model.config
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta  # transformers 5 / 4
    common = dict(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        kv_channels=c.hidden_size // c.num_attention_heads,
        padded_vocab_size=PADDED,
        make_vocab_size_divisible_by=32,
        seq_length=64,
        max_position_embeddings=c.max_position_embeddings,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        iteration=1000,
        lr=3e-4,
    )
    if flavour == "megatron-llm":
        specific = dict(
            num_attention_heads_kv=c.num_key_value_heads,
            glu_activation="swiglu",
            use_rms_norm=True,
            layernorm_epsilon=c.rms_norm_eps,
            rope_theta=theta,
            rope_scaling_factor=1.0,
            tie_embed_logits=False,
            position_embedding_type=_megatron_llm_rotary(),
        )
    else:
        specific = dict(
            group_query_attention=c.num_key_value_heads != c.num_attention_heads,
            num_query_groups=c.num_key_value_heads,
            swiglu=True,
            normalization="RMSNorm",
            norm_epsilon=c.rms_norm_eps,
            rotary_base=int(theta),
            rotary_percent=1.0,
            position_embedding_type="rope",
            untie_embeddings_and_output_weights=True,
            add_bias_linear=False,
            vocab_size=None,
        )
        if flavour == "megatron-llama":
            specific.update(overlapped_distributed_optimizer=True, position_embedding_type="rotary")
    return argparse.Namespace(**{**common, **specific, **extra})


class _PositionEmbeddingType(enum.Enum):
    rotary = 1
    absolute = 2


def _megatron_llm_rotary():
    """Megatron-LLM's PositionEmbeddingType.rotary, pickled under its real name (megatron.model.enums) though
    no megatron package is installed: the module exists only while the fixture is saved."""
    _PositionEmbeddingType.__module__ = "megatron.model.enums"
    _PositionEmbeddingType.__qualname__ = _PositionEmbeddingType.__name__ = "PositionEmbeddingType"
    return _PositionEmbeddingType.rotary


def _names(flavour: str) -> dict[str, str]:
    if flavour == "mcore":
        layer = "decoder.layers.{i}."
        return {
            "embed": "embedding.word_embeddings.weight",
            "final_norm": "decoder.final_layernorm.weight",
            "head": "output_layer.weight",
            "qkv": layer + "self_attention.linear_qkv.weight",
            "attn_norm": layer + "self_attention.linear_qkv.layer_norm_weight",
            "proj": layer + "self_attention.linear_proj.weight",
            "fc1": layer + "mlp.linear_fc1.weight",
            "mlp_norm": layer + "mlp.linear_fc1.layer_norm_weight",
            "fc2": layer + "mlp.linear_fc2.weight",
        }
    layer = "language_model.encoder.layers.{i}."
    return {
        "embed": "language_model.embedding.word_embeddings.weight",
        "final_norm": "language_model.encoder.final_norm.weight"
        if flavour == "legacy"
        else "language_model.encoder.final_layernorm.weight",
        "head": {"megatron-llm": "language_model.lm_head", "megatron-llama": "lm_head.weight"}.get(
            flavour, "language_model.output_layer.weight"
        ),
        "qkv": layer + "self_attention.query_key_value.weight",
        "attn_norm": layer + ("input_norm.weight" if flavour == "legacy" else "input_layernorm.weight"),
        "proj": layer + "self_attention.dense.weight",
        "fc1": layer + "mlp.dense_h_to_4h.weight",
        "mlp_norm": layer
        + ("post_attention_norm.weight" if flavour == "legacy" else "post_attention_layernorm.weight"),
        "fc2": layer + "mlp.dense_4h_to_h.weight",
    }


def _nest(flat: dict[str, object], flavour: str) -> dict:
    """The state dict as Megatron nests it: megatron-core's is flat; the legacy model nests by module, its
    encoder holding "layers.N..." keys ({"language_model": {"encoder": {"layers.0.x.weight": t}}})."""
    if flavour == "mcore":
        return dict(flat)
    out: dict = {}
    for name, value in flat.items():
        if name.startswith("language_model.encoder."):
            encoder = out.setdefault("language_model", {}).setdefault("encoder", {})
            encoder[name.removeprefix("language_model.encoder.")] = value
            continue
        *path, leaf = name.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _layer_tensors(sd: dict, i: int, c, tp: int, flavour: str) -> dict[str, list[torch.Tensor]]:
    """Layer i's pieces per tensor rank, by part."""
    h, heads, kv = f"model.layers.{i}", c.num_attention_heads, c.num_key_value_heads
    d, hidden = c.hidden_size // heads, c.hidden_size
    q, k, v = (sd[f"{h}.self_attn.{n}_proj.weight"] for n in "qkv")
    if flavour == "megatron-llm":
        q, k = halves_to_pairs(q, heads), halves_to_pairs(k, kv)
    if flavour == "megatron-llama":  # each rank: [its q heads; its k heads; its v heads]
        qkv = [torch.cat([q.chunk(tp)[t], k.chunk(tp)[t], v.chunk(tp)[t]]) for t in range(tp)]
    else:
        g = heads // kv
        grouped = torch.cat([q.reshape(kv, g, d, hidden), k.reshape(kv, 1, d, hidden), v.reshape(kv, 1, d, hidden)], 1)
        qkv = list(grouped.reshape(-1, hidden).chunk(tp))
    gate, up = sd[f"{h}.mlp.gate_proj.weight"].chunk(tp), sd[f"{h}.mlp.up_proj.weight"].chunk(tp)
    first, second = (up, gate) if flavour == "megatron-llm" else (gate, up)
    return {
        "qkv": qkv,
        "proj": list(sd[f"{h}.self_attn.o_proj.weight"].chunk(tp, 1)),
        "fc1": [torch.cat([first[t], second[t]]) for t in range(tp)],
        "fc2": list(sd[f"{h}.mlp.down_proj.weight"].chunk(tp, 1)),
        "attn_norm": [sd[f"{h}.input_layernorm.weight"]] * tp,
        "mlp_norm": [sd[f"{h}.post_attention_layernorm.weight"]] * tp,
    }


def write_megatron(
    model,
    directory: Path,
    tp: int = 2,
    pp: int = 2,
    vpp: int = 1,
    flavour: str = "legacy",
    args: argparse.Namespace | None | bool = True,
    iteration: int = 1000,
) -> Path:
    """DIR/iter_{iteration}/mp_rank_TT[_PPP]/model_optim_rng.pt and DIR/latest_checkpointed_iteration.txt;
    flavour: legacy (Megatron-LM), mcore (megatron-core), megatron-llm, megatron-llama. Returns the
    iteration directory."""
    sd, c = model.state_dict(), model.config
    names = _names(flavour)
    pad = torch.randn(PADDED - VOCAB, c.hidden_size, generator=torch.Generator().manual_seed(7))
    embed = list(torch.cat([sd["model.embed_tokens.weight"], pad]).chunk(tp))
    head_full = torch.cat([sd["lm_head.weight"], pad * 0.5])
    head = [head_full] * tp if flavour == "megatron-llama" else list(head_full.chunk(tp))
    if args is True:
        args = megatron_args(
            model, tp, pp, flavour, **({"virtual_pipeline_model_parallel_size": vpp} if vpp > 1 else {})
        )
    saved_module = _register_fake_megatron_enums()
    per_chunk = c.num_hidden_layers // (pp * vpp)
    iter_dir = directory / f"iter_{iteration:07d}"
    try:
        for p in range(pp):
            for t in range(tp):
                chunks = []
                for v in range(vpp):
                    flat: dict[str, object] = {}
                    first_layer = (v * pp + p) * per_chunk
                    for local in range(per_chunk):
                        for part, pieces in _layer_tensors(sd, first_layer + local, c, tp, flavour).items():
                            flat[names[part].format(i=local)] = pieces[t].clone()
                        if flavour == "mcore":  # TransformerEngine's state, pickled as BytesIO
                            flat[f"decoder.layers.{local}.self_attention.core_attention._extra_state"] = io.BytesIO()
                    if p == 0 and v == 0:
                        flat[names["embed"]] = embed[t].clone()
                    if p == pp - 1 and v == vpp - 1:
                        flat[names["final_norm"]] = sd["model.norm.weight"].clone()
                        flat[names["head"]] = head[t].clone()
                    chunks.append(_nest(flat, flavour))
                state: dict[str, object] = {"checkpoint_version": 3.0, "iteration": iteration}
                state.update({"model": chunks[0]} if vpp == 1 else {f"model{v}": m for v, m in enumerate(chunks)})
                if args is not None and args is not False:
                    state["args"] = args
                state["rng_state"] = [{"np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}]
                rank_dir = iter_dir / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
                rank_dir.mkdir(parents=True)
                torch.save(state, rank_dir / "model_optim_rng.pt")
    finally:
        _unregister_fake_megatron_enums(saved_module)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return iter_dir


def _register_fake_megatron_enums():
    names = ("megatron", "megatron.model", "megatron.model.enums")
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules["megatron.model.enums"].PositionEmbeddingType = _PositionEmbeddingType  # type: ignore[attr-defined]
    return saved


def _unregister_fake_megatron_enums(saved) -> None:
    for n, module in saved.items():
        if module is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = module

"""Megatron-LM checkpoints (legacy layout) read as a Hugging Face model, for `llamatron import-megatron`.

`MegatronSource` presents the weights of every tensor-parallel rank and pipeline stage under Hugging Face
names, so the import goes through the same rules and writer as import-hf. What the run's args must say, the
config.json they describe and the Hugging Face names come from the family that has a Megatron format
(models/families/llama/foreign.py). Undone here:
- tensor parallelism: column-parallel weights (fused QKV, fc1, the vocabulary-parallel embedding and output
  layer) are split by rows, row-parallel ones (attention output, fc2) by columns; norms are replicated.
- pipeline parallelism: each stage numbers its layers from 0; stages (and virtual stages: "model0",
  "model1", ... chunk-major over the stages) are concatenated in order.
- fused QKV, rows per KV group g: [the group's query heads; k_g; v_g] (Megatron-LM's legacy
  `query_key_value` and megatron-core's `linear_qkv`; Megatron-LLaMA instead stores each tensor rank's
  [q; k; v]).
- fused SwiGLU fc1, per tensor rank: [gate; up] (Megatron-LM, megatron-core, Megatron-LLaMA); Megatron-LLM
  computes x1 * silu(x2), so its halves are [up; gate].
- rotary layout: Megatron-LLM (and Megatron-LM with --rotary-interleaved) rotate adjacent pairs; rows of q and
  k are reordered to the half-split one, as for Meta's checkpoints.
- vocabulary padding: rows beyond the real vocabulary (when it is known) are dropped.
Which of these a checkpoint uses is read from its stored `args`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..models import ModelConfig
from ..models.families import megatron_format
from ..models.family import MegatronFormat
from ..models.family import megatron_arg as _arg
from .hf import config_to_hf
from .hf_io import special_token_ids, write_imported
from .megatron_files import ShardGrid, find_shards, flat_tensors, iteration_dir, load_megatron_file
from .meta_consolidated import pairs_to_halves

_LAYER = re.compile(r"(?:language_model\.(?:encoder|transformer)\.|decoder\.)layers\.(\d+)\.(.+)")
# Megatron's name within a layer (legacy, Megatron-LLM, megatron-core) -> part
_LAYER_PARTS = {
    "self_attention.query_key_value.weight": "qkv",
    "attention.query_key_value.weight": "qkv",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.dense.weight": "proj",
    "attention.dense.weight": "proj",
    "self_attention.linear_proj.weight": "proj",
    "mlp.dense_h_to_4h.weight": "fc1",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.dense_4h_to_h.weight": "fc2",
    "mlp.linear_fc2.weight": "fc2",
    "input_layernorm.weight": "attn_norm",
    "input_norm.weight": "attn_norm",
    "self_attention.linear_qkv.layer_norm_weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "post_attention_norm.weight": "mlp_norm",
    "pre_mlp_layernorm.weight": "mlp_norm",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm",
}
_GLOBAL_PARTS = {
    "language_model.embedding.word_embeddings.weight": "embed",
    "embedding.word_embeddings.weight": "embed",
    "language_model.encoder.final_layernorm.weight": "final_norm",
    "language_model.encoder.final_norm.weight": "final_norm",
    "language_model.transformer.final_layernorm.weight": "final_norm",
    "decoder.final_layernorm.weight": "final_norm",
    "decoder.final_norm.weight": "final_norm",
    "language_model.output_layer.weight": "head",
    "output_layer.weight": "head",
    "language_model.lm_head": "head",  # Megatron-LLM
    "lm_head.weight": "head",  # Megatron-LLaMA's causal_lm head (replicated)
}
# Not weights of the model: TransformerEngine's state, cached rotary frequencies, the last stage's copy of a
# tied embedding.
_IGNORED = re.compile(r".*(_extra_state|inv_freq)$|word_embeddings_for_head\.weight$")
_LAYER_PART_NAMES = ("attn_norm", "qkv", "proj", "mlp_norm", "fc1", "fc2")


@dataclass(frozen=True)
class MegatronTensorLayout:
    """How a Megatron flavour lays out the rows of what llamatron keeps apart (see the module docstring): within a
    fused tensor, not across ranks (ShardGrid, megatron_files.py, is the shards)."""

    flavour: str
    qkv_per_rank: bool = False  # Megatron-LLaMA: [q; k; v] per tensor rank instead of per KV group
    up_first: bool = False  # Megatron-LLM: fc1 halves [up; gate]
    rotary_pairs: bool = False  # q/k rows in the adjacent-pairs rotary layout


def layout_of(args: Any) -> MegatronTensorLayout:
    if args is None:
        return MegatronTensorLayout("megatron-lm")
    if hasattr(args, "glu_activation") or hasattr(args, "num_attention_heads_kv"):
        return MegatronTensorLayout("megatron-llm", up_first=True, rotary_pairs=True)
    if hasattr(args, "overlapped_distributed_optimizer"):
        return MegatronTensorLayout(
            "megatron-llama", qkv_per_rank=True, rotary_pairs=bool(_arg(args, "rotary_interleaved"))
        )
    return MegatronTensorLayout("megatron-lm", rotary_pairs=bool(_arg(args, "rotary_interleaved")))


def _format() -> MegatronFormat:
    fmt = megatron_format()
    if fmt is None:
        raise CheckpointError("no model family here reads Megatron-LM checkpoints")
    return fmt


class MegatronSource:
    """The weights of one iteration of a Megatron checkpoint under Hugging Face names; `hf_config` describes
    them, `summary` says what was read."""

    def __init__(self, load: str | Path, iteration: int | None, model: ModelConfig | None, vocab_size: int | None):
        load = Path(load)
        self.format = fmt = _format()
        grid = find_shards(iteration_dir(load, iteration))
        shards = {key: load_megatron_file(path) for key, path in grid.files.items()}
        args = shards[(0, 0)].get("args")
        self.layout = layout_of(args)
        if args is None and model is None:
            raise CheckpointError(
                f"{grid.path(0, 0)} stores no args: give the architecture with --model PRESET or --config FILE"
            )
        if args is not None and model is not None:
            raise CheckpointError(
                f"{grid.path(0, 0)} stores its run's args, which give the architecture: "
                "drop --model/--config/--model-override"
            )
        if args is not None:
            _check_args(args, grid)
        self._read_parts(grid, shards)
        padded = sum(t.shape[0] for t in self._globals["embed"])
        vocab = vocab_size or _arg(args, "vocab_size") or (model.vocab_size if model else None)
        self.vocab_known = vocab is not None
        vocab = vocab or padded
        if vocab > padded:
            raise CheckpointError(f"vocabulary {vocab} is larger than the checkpoint's embedding ({padded} rows)")
        self.vocab, self.padded_vocab = int(vocab), padded
        if args is not None:
            try:
                self.hf_config = fmt.hf_config(args, self.vocab, self.layout.flavour)
            except (TypeError, ValueError) as e:  # a size missing (None) or not a number
                raise CheckpointError(f"{grid.path(0, 0)}: its args do not give the model's sizes ({e})") from None
        else:
            assert model is not None
            self.hf_config = config_to_hf(model, vocab_size=self.vocab)
        self.hf_config["tie_word_embeddings"] = "head" not in self._globals
        self._hf_globals = {name: part for part, name in fmt.hf_global_names.items()}
        untied = _arg(args, "untie_embeddings_and_output_weights") or _arg(args, "tie_embed_logits") is False
        if untied and "head" not in self._globals:
            raise CheckpointError(f"{grid.path(0, 0)}: the args untie the output layer, but no shard holds it")
        self.hf_config["torch_dtype"] = str(self._globals["embed"][0].dtype).removeprefix("torch.")
        self._check_shapes(grid)
        self.summary = {"tp": grid.tp, "pp": grid.pp, "layout": self.layout.flavour, "dir": str(grid.path(0, 0))}
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}

    def _read_parts(self, grid: ShardGrid, shards: dict[tuple[int, int], dict[str, Any]]) -> None:
        """self._layers[g][part] and self._globals[part]: the tensor ranks' pieces, in rank order."""
        chunks = _model_chunks(shards[(0, 0)], grid.path(0, 0))
        self._layers: list[dict[str, list[torch.Tensor]]] = []
        self._globals: dict[str, list[torch.Tensor]] = {}
        for v in range(len(chunks)):
            for p in range(grid.pp):
                ranks = [
                    _classify(_model_chunks(shards[(t, p)], grid.path(t, p))[v], grid.path(t, p))
                    for t in range(grid.tp)
                ]
                for t, (layers, globals_) in enumerate(ranks):
                    if set(layers) != set(ranks[0][0]) or set(globals_) != set(ranks[0][1]):
                        raise CheckpointError(
                            f"{grid.path(t, p)} and {grid.path(0, p)} hold different tensors (layers "
                            f"{sorted(layers)} vs {sorted(ranks[0][0])}); the shards are not of one checkpoint"
                        )
                for local in sorted(ranks[0][0]):
                    self._layers.append({part: [r[0][local][part] for r in ranks] for part in ranks[0][0][local]})
                for part in ranks[0][1]:
                    self._globals.setdefault(part, [r[1][part] for r in ranks])
        missing = sorted({"embed", "final_norm"} - set(self._globals))
        if missing:
            raise CheckpointError(f"{grid.path(0, 0)}: no {', '.join(missing)} in any shard of the checkpoint")

    def _check_shapes(self, grid: ShardGrid) -> None:
        hf = self.hf_config
        if len(self._layers) != hf["num_hidden_layers"]:
            raise CheckpointError(
                f"{grid.path(0, 0)}: the shards hold {len(self._layers)} layers, the args say num_layers="
                f"{hf['num_hidden_layers']}"
            )
        for g, layer in enumerate(self._layers):
            absent = [p for p in _LAYER_PART_NAMES if p not in layer]
            if absent:
                raise CheckpointError(f"{grid.path(0, 0)}: layer {g} has no {', '.join(absent)} weights")
        if self.layout.qkv_per_rank and hf["num_key_value_heads"] != hf["num_attention_heads"]:
            raise CheckpointError("Megatron-LLaMA's [q; k; v] per rank layout has no grouped-query attention")

    # ---------------------------------------------------------------- the source protocol (hf_io)

    def keys(self) -> set[str]:
        names = {name for name, part in self._hf_globals.items() if part in self._globals}
        for g in range(len(self._layers)):
            names |= {f"model.layers.{g}.{n}" for n in self.format.hf_layer_names}
        return names

    def meta(self, name: str) -> torch.Tensor:
        t = self.get(name, meta=True)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def get(self, name: str, meta: bool = False) -> torch.Tensor:
        part = self._hf_globals.get(name)
        if part in ("embed", "head"):
            pieces = self._globals[part]
            if part == "head" and all(p.shape[0] == self.padded_vocab for p in pieces):
                return pieces[0][: self.vocab]  # Megatron-LLaMA's causal_lm head: every rank holds all of it
            return _cat(pieces, 0, meta)[: self.vocab]
        if part == "final_norm":
            return self._globals["final_norm"][0]
        g, rest = int(name.split(".")[2]), name.split(".", 3)[3]
        kind, index = self.format.hf_layer_names[rest]
        layer = self._layers[g]
        if kind in ("attn_norm", "mlp_norm"):
            return layer[kind][0]
        if kind in ("proj", "fc2"):
            return _cat(layer[kind], 1, meta)
        key = (g, kind)
        if key not in self._cache or meta:
            parts = (self._qkv if kind == "qkv" else self._gate_up)(layer[kind], meta)
            if meta:
                return parts[index]
            self._cache = {key: parts}  # q, k, v (gate, up) are asked for one after the other
        return self._cache[key][index]

    def _qkv(self, pieces: list[torch.Tensor], meta: bool) -> tuple[torch.Tensor, ...]:
        hf = self.hf_config
        heads, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        rest = pieces[0].shape[1:]
        if self.layout.qkv_per_rank:
            tp = len(pieces)
            split = [p.split([heads * d // tp, kv * d // tp, kv * d // tp]) for p in pieces]
            q, k, v = (_cat([s[i] for s in split], 0, meta) for i in range(3))
        else:
            full = _cat(pieces, 0, meta)
            if full.shape[0] != (heads + 2 * kv) * d:
                raise CheckpointError(
                    f"fused QKV has {full.shape[0]} rows; {heads} heads and {kv} KV groups of {d} need "
                    f"{(heads + 2 * kv) * d}"
                )
            groups = full.reshape(kv, heads // kv + 2, d, *rest)
            q = groups[:, :-2].reshape(heads * d, *rest)
            k, v = groups[:, -2].reshape(kv * d, *rest), groups[:, -1].reshape(kv * d, *rest)
        if self.layout.rotary_pairs and not meta:
            q, k = pairs_to_halves(q, heads), pairs_to_halves(k, kv)
        return q, k, v

    def _gate_up(self, pieces: list[torch.Tensor], meta: bool) -> tuple[torch.Tensor, ...]:
        halves = [p.chunk(2, dim=0) for p in pieces]  # each tensor rank's own two halves
        first, second = _cat([h[0] for h in halves], 0, meta), _cat([h[1] for h in halves], 0, meta)
        return (second, first) if self.layout.up_first else (first, second)


def _cat(pieces: list[torch.Tensor], dim: int, meta: bool) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    if meta:  # the shape only: no data read
        shape = list(pieces[0].shape)
        shape[dim] = sum(p.shape[dim] for p in pieces)
        return torch.empty(shape, dtype=pieces[0].dtype, device="meta")
    return torch.cat(pieces, dim=dim)


def _model_chunks(state: dict[str, Any], where: Path) -> list[Any]:
    if "model" in state:
        return [state["model"]]
    chunks = [state[f"model{i}"] for i in range(len(state)) if f"model{i}" in state]
    if not chunks:
        raise CheckpointError(f"{where} has no 'model' state (keys: {', '.join(map(str, list(state)[:10]))})")
    return chunks


def _classify(model: Any, where: Path) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(local layer -> part -> tensor, part -> tensor) of one chunk of one shard."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    globals_: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, value in flat_tensors(model):
        if _IGNORED.match(name):
            continue
        m = _LAYER.fullmatch(name)
        part = _LAYER_PARTS.get(m.group(2)) if m else _GLOBAL_PARTS.get(name)
        if part is None or not isinstance(value, torch.Tensor):
            unexpected.append(name)
        elif m:
            layers.setdefault(int(m.group(1)), {})[part] = value
        else:
            globals_[part] = value
    if unexpected:
        biases = (
            " (biases: llamatron imports Llama models trained with --disable-bias-linear)"
            if any(n.endswith("bias") for n in unexpected)
            else ""
        )
        raise CheckpointError(
            f"{where} holds tensors a Llama model does not have{biases}: {', '.join(unexpected[:6])}"
            + (f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else "")
        )
    return layers, globals_


def _check_args(args: Any, grid: ShardGrid) -> None:
    problems = _format().args_problems(args)
    for name, have in (("tensor_model_parallel_size", grid.tp), ("pipeline_model_parallel_size", grid.pp)):
        said = _arg(args, name)
        if said is not None and int(said) != have:
            problems.append(f"{name}={said} in the args, but {have} shards on disk")
    if problems:
        raise CheckpointError(f"{grid.path(0, 0)}: {'; '.join(problems)}")


def import_megatron(
    load: str | Path,
    out: str | Path,
    iteration: int | None = None,
    model: ModelConfig | None = None,
    vocab_size: int | None = None,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Path, MegatronSource]:
    """Convert one iteration of the Megatron checkpoint `load` into the llamatron checkpoint `out` (the same
    weights-only checkpoint import-hf writes); returns OUT/step-0 and the source read."""
    if tokenizer is not None and not Path(tokenizer).exists():
        raise CheckpointError(f"--tokenizer {tokenizer} does not exist")
    source = MegatronSource(load, iteration, model, vocab_size)
    # A Megatron checkpoint has no token ids: the tokenizer's, else null (not transformers' Llama 1/2 ones).
    source.hf_config.update(special_token_ids(Path(tokenizer) if tokenizer is not None else None))
    origin = {"source": str(Path(load).resolve()), "format": f"megatron ({source.layout.flavour})"}
    step_dir = write_imported(
        source.hf_config, source, origin, out, dtype, Path(tokenizer) if tokenizer is not None else None
    )
    return step_dir, source


__all__ = ["MegatronTensorLayout", "MegatronSource", "import_megatron", "layout_of"]

"""`import-hf` and `export-hf`: Hugging Face directories <-> llamatron checkpoints, streamed tensor by tensor.

An imported checkpoint is `OUT/step-0/` (model.safetensors, meta.json) with
`OUT/latest` and the tokenizer files in `OUT/tokenizer/`. Its meta.json marks
it `weights_only` (there is no optimizer state: train from it with
--finetune) and keeps the source `config.json` under "hf", so an export
writes back what llamatron does not model (token ids, Falcon's QKV layout).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.pieces import Box
from ..checkpoint.reader import (
    META_FILE,
    MODEL_FILE,
    CheckpointReader,
    inside,
    open_weights,
    read_meta,
    resolve_checkpoint,
)
from ..checkpoint.tensor_io import PrefixedSource, StreamingSafetensorsWriter, TensorSource, TensorSpec, WeightSource
from ..config.settings import RunConfig
from ..data.sft import CHAT_FORMATS, LLAMA3, ChatRenderer, chat_template
from ..data.tokenizer import TiktokenTokenizer, load_tokenizer
from ..dtypes import DTYPES
from ..errors import CheckpointError, HFConversionError
from ..models import ModelConfig, build_model, config_from_dict
from ..models.families import family_for_model_type
from .hf import (
    TensorRule,
    check_hf_names,
    config_from_hf,
    config_to_hf,
    tied_as_loaded,
    training_settings_not_exported,
    weight_rules,
)
from .hf_files import check_hf_files, read_hf_json
from .hf_tokenizer import hf_tokenizer_files
from .meta_consolidated import MetaSource, is_meta_checkpoint

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def open_hf_dir(hf_dir: str | Path) -> tuple[dict[str, Any], TensorSource | MetaSource, str]:
    """The config, the lazily read weights and the format name of a Hugging Face (or Meta) directory."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory")
    if is_meta_checkpoint(d):
        source = MetaSource(d)
        return source.hf_config, source, "meta-consolidated"
    config_file = d / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{d}: no config.json (nor Meta's params.json + consolidated.*.pth)")
    hf = read_hf_json(config_file)
    for weights in _WEIGHT_FILES:
        index = d / f"{weights}.index.json"
        if index.is_file():
            files = sorted(set(_weight_map(index).values()))
            return hf, TensorSource(inside(d, f, str(index)) for f in files), f"{weights.split('.')[-1]} (sharded)"
        if (d / weights).is_file():
            return hf, TensorSource([d / weights]), weights.split(".")[-1]
    raise CheckpointError(
        f"{d}: no weights; expected model.safetensors, pytorch_model.bin or their *.index.json with shards"
    )


class HFWeights:
    """The weights of a Hugging Face (or Meta) directory read as a checkpoint's model tensors (loading.BoxReader),
    each converted when it is read: a model evaluated straight from such a directory, nothing written."""

    def __init__(self, hf_dir: str | Path):
        check_hf_files(hf_dir, tokenizer=False)
        hf, self.source, _ = open_hf_dir(hf_dir)
        hf = _tied_as_loaded(hf, self.source, str(hf_dir))
        self.cfg = config_from_hf(hf)
        rules = weight_rules(self.cfg, hf, self.source.keys())
        check_hf_names(rules, self.source.keys(), self.cfg, str(hf_dir))
        self.rules = {r.name: r for r in rules}

    def read(self, kind: str, name: str, box: Box | None = None) -> torch.Tensor:
        t = self.rules[name].fuse([self.source.get(n) for n in self.rules[name].hf_names])
        return t if box is None else t[box.slices_within(Box.whole(tuple(t.shape)))]


def _weight_map(index: Path) -> dict[str, str]:
    data = read_hf_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to files; re-download it")
    return weight_map


def _check_rules_fit_model(rules: list[TensorRule], cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    expected = {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}
    problems = [f"{n}: converted {shapes.get(n)} vs model {s}" for n, s in expected.items() if shapes.get(n) != s]
    problems += [f"unexpected {n}" for n in shapes if n not in expected]
    if problems:
        raise CheckpointError(
            "converted weights do not fit the model built from config.json:\n  " + "\n  ".join(problems[:40])
        )


def import_hf(hf_dir: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Convert a Hugging Face (or Meta) directory into the llamatron checkpoint `out`; returns OUT/step-0."""
    check_hf_files(hf_dir, tokenizer=True)  # before anything is converted or written
    whole, files, fmt = open_hf_dir(hf_dir)
    hf, source = _text_model_of(whole, files, hf_dir)
    generation = Path(hf_dir) / "generation_config.json"
    return write_imported(
        hf,
        source,
        {"source": str(Path(hf_dir).resolve()), "format": fmt},
        out,
        dtype,
        tokenizer=Path(hf_dir),
        generation_config=read_hf_json(generation) if generation.is_file() else None,
    )


def _text_model_of(hf: dict[str, Any], source: WeightSource, where: str | Path) -> tuple[dict[str, Any], WeightSource]:
    """A multimodal checkpoint's text model (its family says which, `HFAdapter.text_model`), with a one-line notice;
    any other checkpoint as it is."""
    family = family_for_model_type(hf.get("model_type"))
    text = family.hf.text_model(hf) if family is not None else None
    if text is None:
        return hf, source
    text_hf, prefix = text
    left = sum(not n.startswith(prefix) for n in source.keys())
    print(
        f"{where}: a {hf.get('model_type')} model with a vision tower; importing its text model only "
        f"({text_hf.get('model_type')}; {left} vision tensors left out)",
        file=sys.stderr,
    )
    return text_hf, PrefixedSource(source, prefix)


def write_imported(
    hf: dict[str, Any],
    source: WeightSource,
    origin: dict[str, Any],
    out: str | Path,
    dtype: torch.dtype | None,
    tokenizer: Path | None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """The weights-only checkpoint OUT/step-0 of `source`, whose tensors carry Hugging Face names and which
    `hf` (a config.json) describes; `origin` (source, format) goes into meta.json beside the config, and the
    tokenizer files of `tokenizer` (a directory or one file) into OUT/tokenizer. The importers' one writer."""
    hf = _tied_as_loaded(hf, source, origin["source"])
    cfg = config_from_hf(hf)
    rules = weight_rules(cfg, hf, source.keys())
    check_hf_names(rules, source.keys(), cfg, origin["source"])
    specs: list[TensorSpec] = []
    for rule in rules:  # shapes and dtypes from the file headers; no data read yet
        parts = [source.meta(n) for n in rule.hf_names]
        _check_floating(rule.hf_names, parts, origin["source"])
        fused = rule.fuse(parts)
        specs.append((rule.name, dtype or fused.dtype, tuple(fused.shape)))
    _check_rules_fit_model(rules, cfg, {n: s for n, _, s in specs})
    out = Path(out)
    final, tmp = out / "step-0", out / ".tmp-step-0"
    if (out / "latest").exists() or final.exists():
        raise CheckpointError(f"{out} already holds a checkpoint; import into a new directory")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        with StreamingSafetensorsWriter(tmp / MODEL_FILE, specs) as writer:
            for rule in rules:  # one fused tensor in memory at a time
                writer.write(rule.name, _finite_fused(rule, source, dtype, origin["source"]))
    except BaseException:  # a refused tensor (or an interruption): no half-written checkpoint stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    copied = _copy_tokenizer(tokenizer, out / "tokenizer") if tokenizer else None
    run = RunConfig()
    run.data.tokenizer = str(copied.resolve()) if copied else None
    meta = {
        "step": 0,
        "consumed_samples": 0,
        "weights_only": True,
        "config": run.to_dict(),
        "model_config": cfg.to_dict(),
        "tokenizer": run.data.tokenizer,
        "hf": {"config": hf, **origin, "generation_config": generation_config},
        "checksums": {MODEL_FILE: writer.sha256.hexdigest()},  # checked on read; a LoRA run's base fingerprint
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    os.replace(tmp, final)
    latest_tmp = out / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, out / "latest")
    return final


def _tied_as_loaded(hf: dict[str, Any], source: WeightSource, where: str) -> dict[str, Any]:
    """hf.tied_as_loaded, saying so when the head is kept untied (transformers warns the same)."""
    loaded = tied_as_loaded(hf, source.keys(), source.get)
    if loaded != hf:
        print(
            f"{where}: config.json ties the head to the embedding, but the weights hold a distinct lm_head.weight: "
            f"read untied, as transformers loads it (an export writes tie_word_embeddings: false)",
            file=sys.stderr,
        )
    return loaded


def _check_floating(names: tuple[str, ...], tensors: list[torch.Tensor], where: str) -> None:
    """Weights are floating point: an integer or boolean tensor (quantized weights, a mislabelled file) would be
    stored as it is and read as numbers it does not hold."""
    for name, t in zip(names, tensors):
        if not t.dtype.is_floating_point:
            raise HFConversionError(
                f"{where}: {name} is {str(t.dtype).removeprefix('torch.')}, not a floating-point tensor; "
                f"llamatron imports unquantized weights (fp32, bf16 or fp16): convert the model to one of them first"
            )


def _finite_fused(rule: TensorRule, source: WeightSource, dtype: torch.dtype | None, where: str) -> torch.Tensor:
    """The llamatron tensor of `rule`, in `dtype`; a NaN or an infinity in it is refused, naming the tensor (weights
    holding one are never saved, docs/checkpoints.md)."""
    parts = [source.get(n) for n in rule.hf_names]
    for name, t in zip(rule.hf_names, parts):
        if not bool(torch.isfinite(t).all()):
            raise HFConversionError(
                f"{where}: {name} holds a NaN or an infinity; nothing was imported: these weights are broken "
                f"(re-download or re-export the model)"
            )
    tensor = rule.fuse(parts)
    tensor = tensor.to(dtype) if dtype else tensor
    if not bool(torch.isfinite(tensor).all()):  # finite before: out of the range of --dtype
        flag = next(k for k, v in DTYPES.items() if v == dtype)
        raise HFConversionError(
            f"{where}: {', '.join(rule.hf_names)} holds values beyond the range of --dtype {flag}; nothing was "
            f"imported: import with --dtype bf16 or fp32"
        )
    return tensor


def _copy_tokenizer(src: Path, dst: Path) -> Path | None:
    """Copy the tokenizer files of `src` (a directory or one tokenizer file) into `dst`; None if there are none."""
    files = [src] if src.is_file() else [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not files:
        return None
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, dst / f.name)
    return dst


def _is_tokenizer(path: Path) -> bool:
    """A tokenizer file or a directory of tokenizer files that the tokenizer libraries load: a checkpoint's
    meta.json names the path, so anything else (any file on the machine) must not be shipped as one."""
    named = path.is_file() and path.name in TOKENIZER_FILES
    if not (named or (path.is_dir() and any((path / n).is_file() for n in TOKENIZER_FILES))):
        return False
    try:
        load_tokenizer(str(path))
    except Exception:  # not a tokenizer, whatever its name says
        return False
    return True


def find_tokenizer(step_dir: Path, meta: dict[str, Any], explicit: str | None = None) -> Path | None:
    """The tokenizer to ship with an export: --tokenizer, else the one recorded with the checkpoint (or the
    tokenizer/ an import put next to it); None when the checkpoint records none."""
    if explicit is not None:
        if not Path(explicit).exists():
            raise CheckpointError(f"tokenizer {explicit} not found")
        if not _is_tokenizer(Path(explicit)):
            raise CheckpointError(
                f"--tokenizer {explicit} is not a tokenizer ({', '.join(TOKENIZER_FILES)} that loads)"
            )
        return Path(explicit)
    recorded = [c for c in (meta.get("tokenizer"), (meta.get("config") or {}).get("data", {}).get("tokenizer")) if c]
    # OUT/tokenizer of an import is still there when the checkpoint was copied elsewhere as a whole.
    for c in [*recorded[:1], step_dir.parent / "tokenizer", *recorded[1:]]:
        if _is_tokenizer(Path(c)):
            return Path(c)
    if recorded:  # exporting without it would publish a model nobody can tokenize for
        raise CheckpointError(
            f"the checkpoint's tokenizer {recorded[0]} (recorded in {step_dir / META_FILE}) is "
            f"not there any more (moved or deleted), or is not a tokenizer; pass --tokenizer PATH with the "
            f"tokenizer the model was trained with"
        )
    return None


class ShippedTokenizer:
    """The tokenizer an export ships: its bos/eos ids, and the files to write (None: copy the source's files;
    Llama 3's tiktoken tokenizer.model is converted to tokenizer.json, which transformers reads).

    chat_tuned: the model was fine-tuned on conversations (--sft-data). A tokenizer without a chat template then
    ships the format they were rendered in (data/sft.py's choice for this tokenizer: Llama 3's or ChatML), so
    transformers' apply_chat_template writes the text the model learned, and generation stops at its end of turn.
    """

    def __init__(self, path: Path | None, chat_tuned: bool = False) -> None:
        self.path, self.chat_tuned = path, chat_tuned
        self.converted: dict[str, str] | None = None
        self.chat_template: str | None = None  # added to a copied tokenizer_config.json
        # None is written as null on purpose: a missing key makes transformers fill in its per-family defaults
        # (Llama 1/2, Falcon 11), ordinary tokens of a vocabulary trained here.
        self.token_ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
        self.end_of_turn_id: int | None = None  # where generation stops besides eos: the chat template's end of turn
        if path is None:
            return
        try:
            tok = load_tokenizer(str(path))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"tokenizer {path} cannot be read: {e}") from None
        self.token_ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id}
        if isinstance(tok, TiktokenTokenizer):
            self.converted = hf_tokenizer_files(tok)
            self.end_of_turn_id = tok.special_tokens[LLAMA3.end_of_turn]  # the template hf_tokenizer_files writes
        elif chat_tuned:
            renderer = ChatRenderer(str(path), tok)
            if renderer.format in CHAT_FORMATS:  # else the tokenizer's own template, copied with its files
                self.chat_template = chat_template(CHAT_FORMATS[renderer.format])
            self.end_of_turn_id = renderer.end_of_turn_id

    def generation_config(self, hf: dict[str, Any], imported: dict[str, Any] | None) -> dict[str, Any]:
        """generation_config.json: an imported one, else the model's token ids; with the end of a chat turn among
        the eos ids (as Meta's Llama 3 releases have it), so a chat reply ends at <|eot_id|> or <|im_end|>."""
        if imported:
            generation = dict(imported)
            if not self.chat_tuned:  # as it was published
                return generation
        else:
            generation = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
        eos = generation.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        if self.end_of_turn_id is not None and self.end_of_turn_id not in ids:
            generation["eos_token_id"] = [*ids, self.end_of_turn_id] if ids else self.end_of_turn_id
        return generation

    def write(self, out: Path) -> None:
        if self.converted is not None:
            for name, text in self.converted.items():
                (out / name).write_text(text + "\n", encoding="utf-8")
        elif self.path is not None:
            _copy_tokenizer(self.path, out)
            if self.chat_template is not None:
                config_file = out / "tokenizer_config.json"
                config = read_hf_json(config_file) if config_file.is_file() else {}
                config["chat_template"] = self.chat_template
                config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def special_token_ids(tokenizer: Path | None) -> dict[str, int | None]:
    """bos/eos ids of a tokenizer (None for each without one: see ShippedTokenizer), for importers' configs."""
    return ShippedTokenizer(tokenizer).token_ids


def _extra_head(name: str) -> bool:
    return name.startswith("extra_heads.")


def _without_extra_heads(cfg: ModelConfig, step_dir: Path) -> ModelConfig:
    dropped = cfg.without_extra_heads()
    if dropped == cfg:
        raise CheckpointError(f"--drop-mtp: {step_dir}'s model has no multi-token prediction modules; leave it out")
    return dropped


def export_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    tokenizer: str | None = None,
    weights: CheckpointReader | None = None,
    drop_extra_heads: bool = False,
) -> dict[str, Any]:
    """Write checkpoint `ckpt` as a transformers directory; returns a summary (files, tokenizer, config).
    `weights`: the reader of its weights (default: open_weights, the plain model's; a LoRA checkpoint's merged
    reader is adapters/merge.py's). `drop_extra_heads`: leave out the model's extra prediction heads (DeepSeek-V3's
    multi-token prediction modules; models/family.py ExtraHeads), its config.json as the model without them."""
    step_dir = resolve_checkpoint(str(ckpt))
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # Another model's config.json or tokenizer files would be overwritten or mixed with this one's.
        raise CheckpointError(
            f"{out} already exists and is not empty; export into a new directory (or delete {out} first)"
        )
    meta = read_meta(step_dir)
    cfg = config_from_dict(meta["model_config"])
    if drop_extra_heads:
        cfg = _without_extra_heads(cfg, step_dir)
    hf_meta = meta.get("hf") or {}
    base = hf_meta.get("config")
    tok = find_tokenizer(step_dir, meta, tokenizer)  # before writing anything: a missing one is an error
    shipped = ShippedTokenizer(tok, bool(meta.get("chat_tuned")))  # converted before any weight is written
    vocab = min(cfg.vocab_size, (base or {}).get("vocab_size") or cfg.vocab_size)
    source = weights or open_weights(step_dir)  # full tensors by name, from a checkpoint of any layout
    rules = weight_rules(cfg, config_to_hf(cfg, base, vocab_size=vocab))
    missing = sorted({r.name for r in rules} - source.keys())
    extra = sorted(n for n in source.keys() - {r.name for r in rules} if not (drop_extra_heads and _extra_head(n)))
    if missing or extra:
        raise CheckpointError(
            f"{step_dir} does not match its model_config:\n  "
            + "\n  ".join([f"missing {n}" for n in missing] + [f"unexpected {n}" for n in extra])
        )
    specs: list[TensorSpec] = []
    for rule in rules:
        for name, part in zip(rule.hf_names, rule.split(_strip_padding(rule.name, source.meta(rule.name), vocab))):
            specs.append((name, dtype or part.dtype, tuple(part.shape)))
    out_dtype = dtype or specs[0][1]
    hf = config_to_hf(cfg, base, out_dtype, vocab_size=vocab)
    # Trained here (or from Meta's params.json, which has none): the token ids are the tokenizer's; an imported
    # config.json keeps its own.
    hf = dict(sorted({**hf, **{k: v for k, v in shipped.token_ids.items() if k not in (base or {})}}.items()))
    generation = shipped.generation_config(hf, hf_meta.get("generation_config"))
    # Written into a temporary directory beside OUT and renamed into place once complete: a failure half-way
    # (a truncated checkpoint, a full disk) leaves no unreadable model.safetensors behind.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = _write_shards(tmp, specs, _hf_tensors(rules, source, vocab, dtype), max_shard_size)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if generation:
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        shipped.write(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "files": files,
        "tokenizer": str(tok) if tok else None,
        "config": hf,
        "step_dir": str(step_dir),
        "not_exported": training_settings_not_exported(cfg),
    }


def _strip_padding(name: str, t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Vocabulary rows beyond `vocab` (padding for tensor parallelism) are not part of the model."""
    if name in ("embed.weight", "lm_head.weight") and t.shape[0] > vocab:
        return t[:vocab]
    return t


def _hf_tensors(
    rules: list[TensorRule], source: WeightSource, vocab: int, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for rule in rules:  # one llamatron tensor in memory at a time
        for name, part in zip(rule.hf_names, rule.split(_strip_padding(rule.name, source.get(rule.name), vocab))):
            yield name, part.to(dtype) if dtype else part


def _write_shards(
    out: Path, specs: list[TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]], max_shard_size: int
) -> list[str]:
    """Hugging Face's sharding: fill a file up to max_shard_size (one tensor may exceed it alone), plus an index."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec[1].itemsize * int(torch.Size(spec[2]).numel())
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for fname, shard in zip(names, shards):
        with StreamingSafetensorsWriter(out / fname, shard) as writer:
            for _ in shard:
                writer.write(*next(tensors))
    if n > 1:
        total = sum(s[1].itemsize * int(torch.Size(s[2]).numel()) for s in specs)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {spec[0]: fname for fname, shard in zip(names, shards) for spec in shard},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        names.append("model.safetensors.index.json")
    return names


__all__ = [
    "TOKENIZER_FILES",
    "export_hf",
    "find_tokenizer",
    "import_hf",
    "open_hf_dir",
    "special_token_ids",
    "write_imported",
]

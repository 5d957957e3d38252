"""`llamatron import-hf`, `export-hf` and `verify`: the Hugging Face round trip, and the check that it is exact."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..adapters.export import export_adapter
from ..adapters.merge import open_base_weights, open_model_weights
from ..checkpoint.tensor_io import parse_size
from ..config.ranges import SEED, at_least, number_arg
from ..dtypes import DTYPES
from ..errors import ConfigError
from ..inference.verify import DEFAULT_TOLERANCE, compare_with_hf
from ..interop.hf_files import check_hf_files
from ..interop.hf_io import export_hf, import_hf, open_hf_dir
from ..interop.hub import push_to_hub


def register(sub) -> None:
    p = sub.add_parser(
        "import-hf",
        help="convert a Hugging Face (or Meta consolidated) model into a checkpoint",
        description="Convert a Hugging Face directory (config.json, safetensors or .bin, single or "
        "sharded; tokenizer files) or Meta's consolidated.*.pth + params.json into the "
        "llamatron checkpoint OUT (OUT/step-0, OUT/latest, OUT/tokenizer). The result "
        "holds weights only: train from it with --load OUT --finetune.",
    )
    p.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="Hugging Face model directory, or a directory of Meta's consolidated.*.pth and params.json",
    )
    p.add_argument("out", metavar="OUT", help="llamatron checkpoint directory to write")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="store weights in this dtype (default: as given)"
    )
    p.set_defaults(func=cmd_import_hf)
    _register_export(sub)
    _register_verify(sub)


def _register_export(sub) -> None:
    p = sub.add_parser(
        "export-hf",
        help="write a checkpoint as a Hugging Face directory",
        description="Write checkpoint CKPT (DIR or DIR/step-N, saved under any layout) as a directory "
        "transformers.AutoModelForCausalLM.from_pretrained loads: config.json, the weights (one "
        "model.safetensors when they fit in --max-shard-size; else shards of at most that size and "
        "model.safetensors.index.json), tokenizer files.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="llamatron checkpoint: DIR (its latest) or DIR/step-N")
    p.add_argument("out_dir", metavar="OUT_DIR", help="Hugging Face directory to write")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default: 5GB)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or file to ship (default: the checkpoint's)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write the base with its adapters merged in, a plain model (the default)",
    )
    kind.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA checkpoint: write only its adapters, as a PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors) that peft loads onto the base model",
    )
    kind.add_argument(
        "--without-adapters",
        action="store_true",
        help="a LoRA checkpoint: write the base model it was trained on, without its adapters",
    )
    p.add_argument(
        "--base-model",
        metavar="HF_DIR",
        default=None,
        help="with --adapter: the Hugging Face directory of the base model, which adapter_config.json names "
        "(checked to be that model; default: the directory the base was imported from, else "
        "BASE-step-N-hf beside OUT_DIR, with the command that writes it)",
    )
    p.add_argument(
        "--drop-mtp",
        action="store_true",
        help="leave out the multi-token prediction modules (DeepSeek-V3's; kept by default, as published)",
    )
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="then upload OUT_DIR to this Hub repository")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p.set_defaults(func=cmd_export_hf)


def _register_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="compare a checkpoint's logits with transformers' on the same batches",
        description="Run llamatron on CKPT and transformers on HF_DIR over the same random batches; "
        "print max and mean absolute logit difference and loss difference; exit 1 when "
        "the mean difference is above the tolerance.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="llamatron checkpoint: DIR (its latest) or DIR/step-N")
    p.add_argument("--hf", required=True, metavar="HF_DIR", help="Hugging Face directory to compare with")
    p.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="both models run in this dtype (default: fp32)"
    )
    defaults = ", ".join(f"{tol:g} for {name}" for name, tol in DEFAULT_TOLERANCE.items())
    p.add_argument(
        "--tolerance",
        type=number_arg(float, at_least(0.0)),
        default=None,
        help=f"largest mean |logit difference| that passes (default: {defaults})",
    )
    p.add_argument(
        "--batches", type=number_arg(int, at_least(1)), default=4, help="random token batches compared (default: 4)"
    )
    p.add_argument(
        "--batch-size", type=number_arg(int, at_least(1)), default=2, help="sequences per batch (default: 2)"
    )
    p.add_argument(
        "--seq-length",
        type=number_arg(int, at_least(1)),
        default=None,
        help="tokens per sequence (default: 128, or the models' max positions if fewer)",
    )
    p.add_argument(
        "--seed", type=number_arg(int, SEED), default=0, help="seed of the random token batches (default: 0)"
    )
    p.add_argument("--device", default="cpu", help="device both models run on: cpu, cuda, cuda:1 (default: cpu)")
    p.set_defaults(func=cmd_verify)


def cmd_import_hf(args: argparse.Namespace) -> int:
    step_dir = import_hf(args.hf_dir, args.out, DTYPES[args.dtype] if args.dtype else None)
    meta = json.loads((step_dir / "meta.json").read_text())
    c = meta["model_config"]
    print(
        f"imported {args.hf_dir} ({meta['hf']['format']}) -> {step_dir}\n"
        f"  {c['family']}: {c['num_layers']} layers, hidden {c['hidden_size']}, heads {c['num_heads']} "
        f"(kv {c['num_kv_heads']}), vocab {c['vocab_size']}"
        + (f", {c['num_experts']} experts (top-{c['experts_per_token']})" if c.get("num_experts") else "")
        + "\n"
        f"  tokenizer: {meta['tokenizer'] or 'none found'}\n"
        f"  weights only: train with `llamatron train --load {args.out} --finetune ...`"
    )
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    if args.adapter:
        ignored = [
            f for f, v in (("--dtype", args.dtype), ("--tokenizer", args.tokenizer), ("--drop-mtp", args.drop_mtp)) if v
        ]
        if ignored or args.max_shard_size != "5GB":
            flags = ", ".join(ignored + (["--max-shard-size"] if args.max_shard_size != "5GB" else []))
            raise ConfigError(f"--adapter writes the adapters as trained, in one file: drop {flags}")
        summary = export_adapter(args.ckpt, args.out_dir, args.base_model)
        print(f"exported the LoRA adapters of {summary['step_dir']} -> {args.out_dir}: {', '.join(summary['files'])}")
        _print_adapter_base(summary, args.out_dir)
    else:
        if args.base_model:
            raise ConfigError("--base-model names the base of an adapter: give it with --adapter, or drop it")
        summary = export_hf(
            args.ckpt,
            args.out_dir,
            parse_size(args.max_shard_size),
            DTYPES[args.dtype] if args.dtype else None,
            args.tokenizer,
            # a LoRA checkpoint with its adapters merged, or left out
            open_base_weights(args.ckpt) if args.without_adapters else open_model_weights(args.ckpt),
            drop_extra_heads=args.drop_mtp,
        )
        print(f"exported {summary['step_dir']} -> {args.out_dir}: {', '.join(summary['files'])}, config.json")
        _print_tokenizer(summary, args.out_dir)
        if summary["not_exported"]:
            print(f"  not in config.json (training settings it has no key for): {', '.join(summary['not_exported'])}")
    if args.push_to_hub:
        url = push_to_hub(Path(args.out_dir), args.push_to_hub, args.private)
        print(f"  uploaded to {url}")
    return 0


def _print_adapter_base(summary: dict, out_dir: str) -> None:
    load = f"peft.AutoPeftModelForCausalLM.from_pretrained({out_dir!r})"
    if summary["export_base"] is None:
        print(f"  base model: {summary['base']} (adapter_config.json names it; load with {load})")
        return
    print(
        f"  base model: none in Hugging Face format yet; adapter_config.json names {summary['base']}: write it "
        f"there with\n    {summary['export_base']}\n  then load with {load} (or give --base-model HF_DIR)"
    )


def _print_tokenizer(summary: dict, out_dir: str) -> None:
    tokenizer = summary["tokenizer"] or (
        f"none: the checkpoint records no tokenizer, so {out_dir} has no "
        f"tokenizer files; pass --tokenizer PATH to ship one"
    )
    print(f"  tokenizer: {tokenizer}")


def cmd_verify(args: argparse.Namespace) -> int:
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    check_hf_files(args.hf, tokenizer=False)
    open_hf_dir(args.hf)  # a directory with config.json and weights, before transformers is asked to load it
    result = compare_with_hf(
        args.ckpt, args.hf, args.dtype, args.batches, args.batch_size, args.seq_length, args.seed, args.device
    )
    print(
        f"{'batch':>5}  {'max |dlogit|':>12}  {'mean |dlogit|':>13}  {'loss llamatron':>14}  {'loss hf':>9}  "
        f"{'|dloss|':>9}"
    )
    for r in result["rows"]:
        print(
            f"{r['batch']:>5}  {r['max_abs']:>12.3e}  {r['mean_abs']:>13.3e}  {r['loss_llamatron']:>14.6f}  "
            f"{r['loss_hf']:>9.6f}  {r['loss_diff']:>9.3e}"
        )
    ok = result["mean_abs"] <= tolerance
    print(
        f"{args.dtype}, {len(result['rows'])} x {args.batch_size} x {result['seq_length']} tokens: max abs logit "
        f"difference {result['max_abs']:.3e}, mean {result['mean_abs']:.3e}, loss difference "
        f"{result['loss_diff']:.3e}; tolerance mean <= {tolerance:g}: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1

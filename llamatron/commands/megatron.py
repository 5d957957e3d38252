"""`llamatron import-megatron`: a Megatron-LM checkpoint (legacy layout, any tp x pp) into a llamatron one."""

from __future__ import annotations

import argparse

from ..config.model_overrides import add_model_override_argument
from ..config.ranges import at_least, number_arg
from ..config.settings import load_config
from ..dtypes import DTYPES
from ..interop.megatron import import_megatron


def register(sub) -> None:
    p = sub.add_parser(
        "import-megatron",
        help="convert a Megatron-LM checkpoint (Megatron-LLaMA, Megatron-LLM) into a checkpoint",
        description="Convert one iteration of a Megatron-LM checkpoint in the legacy layout "
        "(DIR/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt, any tensor x pipeline parallel layout; "
        "Megatron-LM, megatron-core, Megatron-LLaMA and Megatron-LLM Llama models) into the llamatron "
        "checkpoint OUT (OUT/step-0, OUT/latest), the same weights-only checkpoint import-hf writes: train "
        "from it with --load OUT --finetune. The architecture comes from the args the checkpoint stores; "
        "only the model weights are read, and nothing but tensors, argparse.Namespace, numpy arrays and "
        "Megatron's enums is unpickled.",
    )
    p.add_argument("--load", required=True, metavar="MEGATRON_DIR", help="the directory Megatron saved into")
    p.add_argument("--save", required=True, metavar="OUT", help="the new llamatron checkpoint directory")
    p.add_argument(
        "--iteration",
        type=number_arg(int, at_least(0)),
        default=None,
        help="import DIR/iter_NNNNNNN (default: the one latest_checkpointed_iteration.txt names)",
    )
    p.add_argument(
        "--vocab-size",
        type=number_arg(int, at_least(1)),
        default=None,
        help="the tokenizer's vocabulary: embedding and output rows past it (Megatron's padding) are dropped "
        "(default: the args' --vocab-size if the run gave one, else all rows are kept)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or file to copy into OUT/tokenizer")
    p.add_argument(
        "--model", default=argparse.SUPPRESS, help="preset of the architecture, for a checkpoint without args"
    )
    p.add_argument(
        "--config", default=argparse.SUPPRESS, help="YAML (model, model_overrides) for a checkpoint without args"
    )
    add_model_override_argument(p)  # for a checkpoint without args, as --config's model_overrides
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="store weights in this dtype")
    p.set_defaults(func=cmd_import_megatron)


def cmd_import_megatron(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k) for k in ("model", "config", "model_override") if hasattr(args, k)}
    model = load_config(argparse.Namespace(**given)).model_config() if given else None
    step_dir, source = import_megatron(
        args.load,
        args.save,
        args.iteration,
        model,
        args.vocab_size,
        args.tokenizer,
        DTYPES[args.dtype] if args.dtype else None,
    )
    hf, s = source.hf_config, source.summary
    vocab = f"vocab {source.vocab}"
    if source.vocab < source.padded_vocab:
        vocab += f" (Megatron's padding rows {source.vocab}..{source.padded_vocab - 1} dropped)"
    elif not source.vocab_known:
        vocab += " (every embedding row kept: --vocab-size N drops Megatron's padding)"
    print(
        f"imported {args.load} ({s['layout']}, tp {s['tp']} x pp {s['pp']}) -> {step_dir}\n"
        f"  {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, heads {hf['num_attention_heads']} "
        f"(kv {hf['num_key_value_heads']}), {vocab}\n"
        f"  weights only: train with `llamatron train --load {args.save} --finetune ...`"
    )
    return 0

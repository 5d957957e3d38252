"""`llamatron eval`: a checkpoint (any layout) or a Hugging Face directory evaluated on lm-evaluation-harness tasks
(`--tasks`, lm-eval's names for its options) and/or for perplexity on a `.bin/.idx` set (`--data-path`). One
process, one device."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.output_paths import check_output_file
from ..config.ranges import SEED, above, at_least, number_arg
from ..data.indexed import IndexedDataset
from ..data.tokenizer import Tokenizer, load_tokenizer
from ..dtypes import DTYPES
from ..errors import ConfigError
from ..inference import lm_eval_harness
from ..inference.model_source import load_model, model_config, recorded_tokenizer
from ..inference.perplexity import perplexity
from ..training.validate import resolve_device


def register(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on lm-evaluation-harness tasks or a token set's perplexity",
        description="Evaluate a llamatron checkpoint (DIR or DIR/step-N, saved under any layout; a LoRA one with "
        "its adapters merged) or a Hugging Face directory on lm-evaluation-harness tasks (--tasks; needs the "
        "`eval` extra: pip install 'llamatron[eval]') and/or for loss and perplexity on a .bin/.idx token set "
        "(--data-path). One process.",
    )
    p.add_argument("--load", default=None, help="checkpoint directory, or a Hugging Face model directory")
    p.add_argument("--tasks", default=None, help="lm-eval task names or glob patterns, comma-separated")
    p.add_argument("--include-path", default=None, help="a directory of task YAML files added to lm-eval's own")
    p.add_argument("--output", "--output-path", dest="output", default=None, help="write the results here as JSON")
    p.add_argument(
        "--batch-size", type=number_arg(int, at_least(1)), default=8, help="sequences per forward (default: 8)"
    )
    p.add_argument(
        "--limit",
        type=number_arg(float, above(0.0)),
        default=None,
        help="examples per task (below 1: that fraction of them); with --data-path: its first N documents",
    )
    p.add_argument(
        "--num-fewshot", type=number_arg(int, at_least(0)), default=None, help="few-shot examples (default: the task's)"
    )
    p.add_argument("--data-path", default=None, metavar="PREFIX", help="a .bin/.idx token set: loss and perplexity")
    p.add_argument(
        "--seq-length",
        type=number_arg(int, at_least(1)),
        default=None,
        help="with --data-path: tokens per window (default: the model's context)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the checkpoint's, or the HF directory's)")
    p.add_argument("--seed", type=number_arg(int, SEED), default=0, help="seed of lm-eval's few-shot sampling")
    p.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto (default): cuda when available"
    )
    p.add_argument(
        "--precision", default="auto", choices=("auto", *DTYPES), help="weights' dtype (auto: bf16 on GPU, fp32 on CPU)"
    )
    p.set_defaults(func=cmd_eval)


def _check_args(args: argparse.Namespace) -> None:
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ConfigError("eval runs as one process: launch it without torchrun")
    if args.load is None:
        raise ConfigError("--load is missing: give the checkpoint (or Hugging Face directory) to evaluate")
    if args.tasks is None and args.data_path is None:
        raise ConfigError("nothing to evaluate: give --tasks NAMES (lm-eval tasks) and/or --data-path PREFIX")
    for flag, value in (("--include-path", args.include_path), ("--num-fewshot", args.num_fewshot)):
        if value is not None and args.tasks is None:
            raise ConfigError(f"{flag} applies to lm-eval tasks: add --tasks NAMES")
    if args.seq_length is not None and args.data_path is None:
        raise ConfigError("--seq-length is the perplexity window: add --data-path PREFIX")
    if args.output is not None:  # a directory, or a place that cannot be written, before the evaluation runs
        check_output_file(args.output, "--output", example="results.json")
    if not Path(args.load).exists():
        raise ConfigError(f"--load {args.load}: no such checkpoint or directory")


def _tokenizer(args: argparse.Namespace, vocab_size: int) -> Tokenizer:
    path = args.tokenizer or recorded_tokenizer(args.load)
    if path is None:
        raise ConfigError(f"{args.load} records no tokenizer (trained on --mock-data?); pass --tokenizer PATH")
    if not os.path.exists(path):
        raise ConfigError(f"tokenizer {path} (recorded with {args.load}) not found; pass --tokenizer PATH")
    tok = load_tokenizer(path)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {path} has {tok.vocab_size} tokens but the model only {vocab_size}: not its own")
    if tok.eod_id is None:
        raise ConfigError(f"tokenizer {path} has no end-of-sequence token, which lm-eval's requests need")
    return tok


def cmd_eval(args: argparse.Namespace) -> int:
    _check_args(args)
    device, dtype_name = resolve_device(args.device, args.precision, torch.cuda.is_available())
    cfg = model_config(args.load)
    # every task name known, the tokenizer and the data there, before the model loads
    tasks = _resolve_tasks(args, cfg.vocab_size) if args.tasks is not None else None
    dataset = IndexedDataset(args.data_path) if args.data_path is not None else None
    seq_length = args.seq_length or cfg.max_seq_length
    if seq_length > cfg.max_seq_length:
        raise ConfigError(f"--seq-length {seq_length}: beyond the model's context of {cfg.max_seq_length} tokens")
    model = load_model(args.load, device, DTYPES[dtype_name])
    results: dict = {}
    if tasks is not None:
        harness_tasks = lm_eval_harness()
        names, manager, tokenizer = tasks
        lm = harness_tasks.LlamatronLM(model, tokenizer, args.batch_size)
        results = harness_tasks.run_tasks(lm, manager, names, args.limit, args.num_fewshot, args.seed)
        print(harness_tasks.results_table(results))
    if dataset is not None:
        documents = None if args.limit is None else max(1, int(args.limit))
        ppl = perplexity(model, dataset, seq_length, args.batch_size, documents)
        print(
            f"{args.data_path}: loss {ppl['loss']:.4f}, perplexity {ppl['perplexity']:.3f} over {ppl['tokens']} "
            f"predicted tokens ({ppl['windows']} windows of up to {seq_length + 1} tokens)"
        )
        results["perplexity"] = {"data_path": args.data_path, "seq_length": seq_length, **ppl}
    if args.output is not None:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)  # check_output_file: it can be created
        Path(args.output).write_text(json.dumps(results, indent=2, default=_plain, ensure_ascii=False) + "\n")
        print(f"results written to {args.output}")
    return 0


def _resolve_tasks(args: argparse.Namespace, vocab_size: int) -> tuple[list[str], Any, Tokenizer]:
    """The task names, lm-eval's task index holding them, the tokenizer; ConfigError for an unknown name."""
    harness_tasks = lm_eval_harness()
    names = harness_tasks.split_names(args.tasks)
    problems = harness_tasks.task_problems(names, args.include_path)
    if problems:
        raise ConfigError(problems[0])
    return names, harness_tasks.task_manager(names, args.include_path), _tokenizer(args, vocab_size)


def _plain(value: Any) -> Any:
    """JSON for what lm-eval's results hold besides plain values: numpy numbers, sets, functions (by name)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)

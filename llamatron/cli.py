"""`llamatron <command>`: parses arguments and calls the modules that do the work."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .config import ConfigError, add_config_arguments, load_config
from .data.indexed import DataError


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (no data given: the embedded demo corpus)",
                       description="Train a model. With no --data and no --mock-data it trains llama-tiny on the "
                                   "Python standard library's source (the demo), then samples from it.")
    add_config_arguments(p)
    add_launch_argument(p)
    p.set_defaults(func=cmd_train)


def add_launch_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start torchrun with this many processes on this machine (one per GPU)")


def relaunch_if_asked(args: argparse.Namespace, cfg) -> int | None:
    """With --nproc-per-node: check the settings once, here (rather than once per spawned rank), then run this
    command under torchrun and return its exit status; without it, None."""
    if not args.nproc_per_node:
        return None
    import torch

    from .config import validate

    validate(cfg, args.nproc_per_node, torch.cuda.is_available())
    return _relaunch_with_torchrun(args.nproc_per_node)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    status = relaunch_if_asked(args, cfg)
    if status is not None:
        return status
    demo = cfg.data.data is None and not cfg.data.mock_data and cfg.data.sft_data is None
    replace_save = False
    if demo:
        _apply_demo_defaults(cfg)
        replace_save = _clear_previous_demo_checkpoint(cfg)
    from .train import run_training

    result = run_training(cfg, replace_save=replace_save)
    if demo and result.checkpoint and int(os.environ.get("RANK", "0")) == 0:
        _print_demo_summary(result)
    return 0


# The demo's settings where the user gave none: llama-tiny learns code in a few CPU minutes.
DEMO_DEFAULTS = {"seq_length": 256, "micro_batch_size": 8, "global_batch_size": 16, "train_steps": 200, "lr": 2e-3,
                 "min_lr": 2e-4, "warmup_steps": 20, "eval_interval": 50, "eval_iters": 8, "save": "runs/demo/checkpoint"}


def _apply_demo_defaults(cfg) -> None:
    from .config import _section_of

    for key, value in DEMO_DEFAULTS.items():
        if key not in cfg.explicit:
            setattr(getattr(cfg, _section_of(key)), key, value)


def _clear_previous_demo_checkpoint(cfg) -> bool:
    """The demo's own checkpoint directory (no --save given) holds the previous demo run: a new run replaces it,
    where a run saving into another run's directory is refused (train.check_save_dir)."""
    if "save" in cfg.explicit or cfg.train.load:
        return False
    save = cfg.train.save
    if os.environ.get("RANK", "0") == "0" and os.path.isdir(save) and os.listdir(save):
        import shutil

        print(f"replacing the previous demo run's checkpoints in {save}", flush=True)
        shutil.rmtree(save)
    return True


def _print_demo_summary(result) -> None:
    from .data.tokenizer import load_tokenizer
    from .generate import load_for_generation, sample
    from .train import DEMO_DIR

    if result.valid:
        first, last = result.valid[0], result.valid[-1]
        from .evaluation import format_metrics

        metrics = {k: v for k, v in last.items() if k not in ("step", "split", "consumed_samples")}
        print(f"validation loss {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']} "
              f"({format_metrics(metrics)})")
    model, _ = load_for_generation(result.checkpoint)
    tok = load_tokenizer(os.path.join(DEMO_DIR, "data", "tokenizer"))
    ids = sample(model, tok.encode("def "), max_new_tokens=80, temperature=0.7, seed=0)
    print(f"checkpoint: {result.checkpoint}\nsample (prompt 'def '):\n" + "-" * 40 + "\ndef " + tok.decode(ids) + "\n" + "-" * 40)


def _relaunch_with_torchrun(nproc: int) -> int:
    import subprocess

    argv = sys.argv[1:]
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        out.append(a)
    # --standalone: a single-node job with its own rendezvous on a free local port.
    cmd = [sys.executable, "-m", "llamatron.local_launch", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "llamatron", *out]
    import signal

    launcher = subprocess.Popen(cmd)
    # A stop signal to this process (a scheduler's SIGTERM) goes on to the ranks, through the launcher, and
    # this process waits for them to save and exit; Ctrl-C reaches every process of the terminal by itself.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: launcher.send_signal(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    return launcher.wait()


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--load", required=True, help="checkpoint directory (DIR or DIR/step-N)")
    p.add_argument("--prompt", default="", help="text to continue (may be empty only when the tokenizer has a "
                                                "beginning-of-sequence token: sampling then starts from it)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the one recorded in the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default: 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from .checkpoint.reader import read_meta
    from .data.tokenizer import load_tokenizer
    from .generate import load_for_generation, sample

    if not args.temperature >= 0:  # also NaN
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0: greedy)")
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 1 (1: always the likeliest token)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    meta = read_meta(args.load)  # tokenizer and prompt are checked before the weights are read
    tokenizer = args.tokenizer or meta.get("tokenizer") or (meta.get("config") or {}).get("data", {}).get("tokenizer")
    if tokenizer is None:
        raise ConfigError(f"checkpoint {args.load} records no tokenizer (trained on --mock-data?); "
                          f"pass --tokenizer PATH")
    if not os.path.exists(tokenizer):
        raise ConfigError(f"tokenizer {tokenizer} (recorded in the checkpoint) not found; pass --tokenizer PATH")
    tok = load_tokenizer(tokenizer)
    vocab_size = meta["model_config"]["vocab_size"]
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens but the model only "
                          f"{vocab_size}: it is not this model's tokenizer")
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        if tok.bos_id is None:
            raise ConfigError(f"--prompt is empty and tokenizer {tokenizer} has no beginning-of-sequence token to "
                              f"start from; give --prompt TEXT")
        prompt_ids = [tok.bos_id]  # as transformers' generate does without input
    model, _ = load_for_generation(args.load, args.device)
    ids = sample(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + tok.decode(ids))
    return 0


def _preprocess_parser(sub) -> None:
    from .data.preprocess import add_preprocess_arguments, run_preprocess

    p = sub.add_parser("preprocess", help="tokenize jsonl/parquet (text or conversations) into Megatron-format .bin/.idx")
    add_preprocess_arguments(p)
    p.set_defaults(func=lambda a: run_preprocess(a) and 0)  # the summary is printed, not an exit status


class _Parser(argparse.ArgumentParser):
    """Errors as two lines (the error, where the options are) instead of argparse's full usage first, which
    for train and bench is ~50 lines that push the error out of sight."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help` for the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llamatron", description="Distributed trainer for LLaMA-family models.")
    parser.add_argument("--version", action="version", version=f"llamatron {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _train_parser(sub)
    _preprocess_parser(sub)
    _generate_parser(sub)
    for register in _module_commands():
        register(sub)
    return parser


def _module_commands() -> list:
    """Commands living in their own modules; each module's `register` adds its sub-parser."""
    from . import bench, plan_cli
    from .checkpoint import hf_cli

    return [hf_cli.register, bench.register, plan_cli.register]


def _reject_unknown(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> None:
    import difflib

    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    target = sub_action.choices.get(command, parser) if command else parser
    known = [opt for action in target._actions for opt in action.option_strings]
    hints = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=")[0], known, n=2, cutoff=0.6)
        if arg.startswith("--") and close:
            hints.append(f"{arg.split('=')[0]}: did you mean {' or '.join(close)}?")
    target.error(f"unrecognized arguments: {' '.join(unknown)}" + ("\n" + "\n".join(hints) if hints else ""))


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report against the command's own usage, with the nearest real flags
        _reject_unknown(parser, args.command, unknown)
    if args.command is None:
        parser.print_help()
        sys.exit(0)
    first_rank = os.environ.get("RANK", "0") == "0"  # under torchrun every rank fails alike: say it once
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        # Growable segments instead of fixed blocks: far less fragmentation when activations of
        # changing sizes come and go (read at CUDA's first allocation, inherited by torchrun's workers).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        sys.exit(args.func(args))
    except ConfigError as e:
        if first_rank:
            print(f"llamatron {args.command}: configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    except DataError as e:  # a bad input or data file (also a missing one): the message names it
        print(f"llamatron {args.command}: data error: {e}", file=sys.stderr)
        sys.exit(2)
    except FileNotFoundError as e:  # an input path that does not exist
        if first_rank:
            print(f"llamatron {args.command}: file not found: {e.filename or e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        from .errors import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"llamatron {args.command}: checkpoint error: {e}", file=sys.stderr)
            sys.exit(2)
        from .faults import TrainingAborted

        if isinstance(e, TrainingAborted):  # too many non-finite steps, a hung rank: the message says what to do
            if e.rank_specific or os.environ.get("RANK", "0") == "0":
                print(f"llamatron {args.command}: stopped: {e}", file=sys.stderr)
            sys.exit(1)
        raise

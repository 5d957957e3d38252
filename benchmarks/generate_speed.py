"""Generation speed: llamatron's decoder against transformers' generate, in one run (issue 37).

For each case (a preset with random weights, and a batch size) and each system, one untimed warm-up call (CUDA-graph
capture, compilation), then one timed call; greedy with no stopping rule, so every row makes exactly --new-tokens
tokens. tokens/s = batch x new tokens / the wall time of that call (the prefill of the --prompt-tokens prompts
included). Systems:

- llamatron: inference/decode.Decoder, the step captured in a CUDA graph (`llamatron generate`'s default on GPU);
- llamatron-compile: the same with the step torch.compiled before its capture (`llamatron generate --compile`);
- llamatron-eager: the same decoder with each step run eagerly (no graph: what a step costs in launches);
- llamatron-torch-attention: the graph, with each layer's step attention as torch ops (two cache scatters, matmul,
  softmax, matmul) instead of kernels/decode_attention_op.py's one kernel: the A/B of that kernel;
- hf-eager: transformers' generate with its default (dynamic) cache;
- hf-static: transformers' generate with cache_implementation="static", which it compiles on CUDA
  (torch.compile, mode reduce-overhead: its CUDA graphs).

Both implementations hold the same weights (llamatron's, converted to transformers' names): `agree` is the number
of leading tokens of row 0 equal to the first system's, a check that each generated what the model says (bf16 greedy
on random weights can part at a near tie). One JSON line per (case, system) is appended to --out.

    python3 benchmarks/generate_speed.py --out benchmarks/results-generate.jsonl   # the issue's 3 cases, 5 systems
    python3 benchmarks/generate_speed.py --cases llama-tiny:2 --systems llamatron,hf-eager --device cpu --out x.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's llamatron, not an installed one

from llamatron.dtypes import DTYPES  # noqa: E402
from llamatron.inference.decode import Decoder  # noqa: E402
from llamatron.interop.hf import config_to_hf, llamatron_to_hf  # noqa: E402
from llamatron.kernels import decode_attention_op  # noqa: E402
from llamatron.models import build_model, get_preset, materialize  # noqa: E402
from llamatron.training.validate import resolve_device  # noqa: E402

SYSTEMS = ("llamatron", "llamatron-compile", "llamatron-eager", "llamatron-torch-attention", "hf-eager", "hf-static")
CASES = "llama-1b:1,llama2-7b:1,llama-1b:32"  # targets on one H200: >= 1,000, >= 150, >= 15,000 tokens/s


def timed(run: Callable[[], list[list[int]]], device: str) -> tuple[float, list[list[int]]]:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def hf_model(model, dtype: torch.dtype, device: str):
    """transformers' model of llamatron's `model` (the same weights)."""
    import transformers

    hf = config_to_hf(model.cfg, dtype=dtype)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with torch.device(device):
        theirs = transformers.AutoModelForCausalLM.from_config(config, **{dtype_arg: dtype})
    state = llamatron_to_hf(model.state_dict(), model.cfg, hf)
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    if missing or unexpected:
        print(f"warning: transformers' model: missing {missing[:3]}, unexpected {unexpected[:3]}", flush=True)
    theirs.generation_config.eos_token_id = None  # no stopping rule: exactly --new-tokens tokens a row
    theirs.generation_config.pad_token_id = 0
    return theirs.eval()


@contextlib.contextmanager
def decode_kernel(on: bool) -> Iterator[None]:
    """The decoding step's attention kernel on (the default) or off (its torch ops), for the A/B."""
    kept = decode_attention_op.triton_check
    if not on:
        decode_attention_op.triton_check = types.SimpleNamespace(kernels_on=lambda backend, x: False)  # type: ignore[assignment]
    try:
        yield
    finally:
        decode_attention_op.triton_check = kept


def runners(system: str, model, prompts: torch.Tensor, new: int, device: str, dtype: torch.dtype, hf_cache: dict):
    """(build, run) of one system: build once (untimed), then run() returns each row's new tokens."""
    batch, length = prompts.shape
    rows = prompts.tolist()
    if system.startswith("llamatron"):
        mode = {"llamatron-compile": dict(compile=True), "llamatron-eager": dict(cuda_graph=False)}
        kernel = system != "llamatron-torch-attention"
        with decode_kernel(kernel):  # captured (or not) now: the graph keeps what it recorded
            decoder = Decoder(model, batch, length + new, **mode.get(system, {}))  # type: ignore[arg-type]
            decoder.generate(rows, 2)
        if kernel:
            return lambda: decoder.generate(rows, new)

        def run_without_kernel() -> list[list[int]]:
            with decode_kernel(False):
                return decoder.generate(rows, new)

        return run_without_kernel
    if "model" not in hf_cache:
        hf_cache["model"] = hf_model(model, dtype, device)
    theirs = hf_cache["model"]
    extra = {"cache_implementation": "static"} if system == "hf-static" else {}

    def run() -> list[list[int]]:
        with torch.no_grad():
            out = theirs.generate(
                prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, do_sample=False, **extra
            )
        return out[:, length:].tolist()

    return run


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON-lines file the records are appended to")
    p.add_argument("--cases", default=CASES, help=f"PRESET:BATCH,... (default: {CASES})")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--precision", default="auto", choices=("auto", *DTYPES))
    args = p.parse_args()
    systems = args.systems.split(",")
    if unknown := [s for s in systems if s not in SYSTEMS]:
        p.error(f"--systems: {unknown} not among {SYSTEMS}")
    device, dtype_name = resolve_device(args.device, args.precision, torch.cuda.is_available())
    dtype = DTYPES[dtype_name]
    common = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype_name,
        "torch": torch.__version__,
        "commit": commit(),
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
    }
    try:
        import transformers

        common["transformers"] = transformers.__version__
    except ImportError:
        pass
    for case in args.cases.split(","):
        preset, batch = case.split(":")
        cfg = get_preset(preset)
        model = materialize(build_model(cfg), cfg, 0, device, dtype).eval()
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, cfg.vocab_size, (int(batch), args.prompt_tokens), generator=gen).to(device)
        hf_cache: dict = {}
        first: list[int] | None = None
        for system in systems:
            record = {"case": case, "model": preset, "batch": int(batch), "system": system}
            try:  # one system failing (a compiler error, say) is recorded, and the others still run
                run = runners(system, model, prompts, args.new_tokens, device, dtype, hf_cache)
                warmup, _ = timed(run, device)
                seconds, out = timed(run, device)
                assert all(len(row) == args.new_tokens for row in out), [len(row) for row in out]
                first = out[0] if first is None else first
                agree = next((i for i, (a, b) in enumerate(zip(out[0], first)) if a != b), len(first))
                record.update(tokens_per_sec=round(int(batch) * args.new_tokens / seconds, 1))
                record.update(seconds=round(seconds, 4), warmup_seconds=round(warmup, 2), agree=agree)
            except Exception as e:
                record["error"] = f"{type(e).__name__}: {e}"[:2000]
            record.update(common, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
            print(json.dumps(record), flush=True)
            with Path(args.out).open("a") as f:
                f.write(json.dumps(record) + "\n")
        del model, hf_cache
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

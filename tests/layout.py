"""Run `llamatron train` under a layout and compare it with the single-process reference.

The correctness method of docs/design.md (Testing): same seed and data, every field of every step's record and
of the evaluation records (loss, grad norm, learning rate, the samples counted, DPO's rewards, a mixture of
experts' router statistics, ...) must agree with the single-process fp32 run; only speed and memory may differ.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from llamatron.checkpoint.reader import load_full_tensors

BASE_ARGS = [
    "--mock-data",
    "--device",
    "cpu",
    "--precision",
    "fp32",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-steps",
    "5",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--warmup-steps",
    "1",
    "--no-progress",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
]


# What a layout changes without computing anything differently: its speed and memory per GPU.
UNCOMPARED = frozenset({"tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib"})


class Records(list):
    """run_train's per-step records; `valid`: the run's evaluation records, which assert_matches compares too."""

    valid: list[dict] = []


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up by default), in a block of its own for each
    pytest-xdist worker. A port the kernel hands out (bind to 0) comes from the range every outgoing connection
    draws from, so under parallel tests another job's gloo connection could take it before torchrun binds it
    (seen as EADDRINUSE); here only our own servers use these ports, and never two workers the same one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = 20000 + 600 * (int(worker) % 20 if worker.isdigit() else 0)
    for port in random.sample(range(low, low + 600), 600):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}-{low + 599}")


def run_train(
    args: list[str],
    nproc: int,
    workdir: Path,
    model: str = "llama-test",
    timeout: int = 300,
    include_eval: bool = False,
    faults: Sequence[str] = (),
    mock_data: bool = True,
    stdout: list[str] | None = None,
) -> list[dict]:
    """Train through the public command; returns the per-step metric records (evaluation lines only if asked).

    nproc > 1: one `python -m llamatron train` per rank, given the environment torchrun gives its ranks (torchrun
    itself, one more process importing torch, ~1.7 s of CPU a run, only with faults: tests/test_ops.py and
    tests/test_launch_files.py test the launchers). faults: flags of tests/inject_faults.py (e.g.
    ["--fail-save", "4:1"]), which then runs the command; mock_data False: BASE_ARGS without --mock-data (`args`
    name the data); stdout: a list that gets the ranks' standard output."""
    metrics = workdir / f"metrics-{nproc}-{abs(hash(tuple(args))) % 10**8}.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [sys.executable]
    if nproc > 1 and faults:
        cmd += [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
        ]
    inject = str(Path(__file__).resolve().parent / "inject_faults.py")
    entry = [inject, *faults, "--"] if faults else ["-m", "llamatron"]
    base = [a for a in BASE_ARGS if mock_data or a != "--mock-data"]
    cmd += [*entry, "train", "--model", model, *base, *args, "--metrics-file", str(metrics)]
    repo = str(Path(__file__).resolve().parents[1])  # importable even where the package is not installed
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    if nproc > 1 and not faults:
        code, out, err = _run_ranks(cmd, nproc, env, workdir, timeout)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    if code != 0:
        raise AssertionError(f"command failed ({code}): {' '.join(cmd)}\n{out[-3000:]}\n{err[-6000:]}")
    if stdout is not None:
        stdout.append(out)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    out = Records(records if include_eval else [r for r in records if r.get("split") is None])
    out.valid = [r for r in records if r.get("split") is not None]
    return out


def _run_ranks(cmd: list[str], nproc: int, env: dict, workdir: Path, timeout: float) -> tuple[int, str, str]:
    """`cmd` once per rank with torchrun's rank variables (env:// rendezvous, rank 0 hosts the store); as torchrun
    does, the first rank to fail gets the others SIGTERM. Returns the first failure's exit code (else 0) and the
    ranks' stdout and stderr, rank by rank."""
    port, procs, outputs = str(free_port()), [], []
    for rank in range(nproc):
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GROUP_RANK": "0", **ranks}
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env={**env, **rendezvous}, cwd=workdir))
        outputs.append((out, err))
    deadline, code, timed_out = time.monotonic() + timeout, 0, False
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            timed_out = time.monotonic() > deadline
            if failed or timed_out:
                code = failed[0] if failed else -signal.SIGTERM
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                break
            time.sleep(0.05)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    code = code or next((p.returncode for p in procs if p.returncode != 0), 0)
    texts = []
    for out, err in outputs:
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, "".join(o for o, _ in texts), "".join(e for _, e in texts))
    return code, "".join(o for o, _ in texts), "".join(e for _, e in texts)


def assert_matches(
    reference: list[dict],
    got: list[dict],
    rtol: float = 1e-4,
    keys: Sequence[str] | None = None,
    atol: Mapping[str, float] | None = None,
) -> None:
    """Each record of `got` agrees with the reference's (to rtol of the reference's value, plus rtol/1000 for values
    near 0, plus atol[field] where given: a difference of two larger numbers, such as DPO's rewards): every field
    but UNCOMPARED, the same fields in both, unless `keys` names those to compare (where a run differs by design,
    e.g. fp8 against bf16); then, when both are run_train's, their evaluations."""
    atol = atol or {}
    assert len(reference) == len(got) > 0, (len(reference), len(got))
    for ref, rec in zip(reference, got):
        assert (ref["step"], ref.get("split")) == (rec["step"], rec.get("split"))
        where = f"step {ref['step']}{' ' + ref['split'] if ref.get('split') else ''}"
        if keys is None:
            assert ref.keys() - UNCOMPARED == rec.keys() - UNCOMPARED, f"{where}: {sorted(ref.keys() ^ rec.keys())}"
        for key in sorted(ref.keys() - UNCOMPARED) if keys is None else keys:
            _assert_close(ref[key], rec[key], rtol, rtol * 1e-3 + atol.get(key, 0.0), f"{where} {key}")
    valid = getattr(reference, "valid", None), getattr(got, "valid", None)
    if keys is None and valid[0] is not None and valid[1] is not None:
        assert len(valid[0]) == len(valid[1]), f"evaluations: {len(valid[0])} in the reference, {len(valid[1])}"
        if valid[0]:
            assert_matches(valid[0], valid[1], rtol, None, atol)


def _assert_close(a, b, rtol: float, atol: float, what: str) -> None:
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, rtol, atol, f"{what}[{i}]")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        assert abs(a - b) <= rtol * abs(a) + atol, f"{what}: reference {a} vs {b}"
    else:
        assert a == b, f"{what}: reference {a!r} vs {b!r}"


def assert_same_weights(reference: Path, got: Path, rtol: float = 1e-3) -> None:
    """Two checkpoints' full tensors agree, each to `rtol` of its norm: catches a wrong gradient of a small weight
    that the loss and the global grad norm hardly see (Adam normalises its size away: e.g. a gate's gradient left
    partial under tp). By norm, not element: Adam turns an element's gradient that cancels to about zero into a full
    step of either sign, so one element in thousands may move by lr-sized noise from the reduction order (seen:
    1.7e-4 of a zero-initialised bias's norm after 5 steps; a gate's gradient left partial: 0.1)."""
    want, have = load_full_tensors(reference), load_full_tensors(got)
    assert want.keys() == have.keys(), sorted(want.keys() ^ have.keys())
    for name, tensor in want.items():
        gap = (have[name] - tensor).norm().item() / tensor.norm().item()
        assert gap <= rtol, f"{name}: {gap:.3g} of its norm from the reference's"


def single_runs(tmp_path_factory, args: Callable[[str, Path], list[str]], model: Callable[[str], str]):
    """For a module fixture: key -> the single process's per-step metrics and final weights, each key run once.
    args(key, workdir): its flags (--save is added); model(key): its --model."""
    runs: dict[str, tuple[list[dict], Path]] = {}

    def get(key: str) -> tuple[list[dict], Path]:
        if key not in runs:
            path = tmp_path_factory.mktemp(f"single-{key or 'preset'}")
            runs[key] = run_train([*args(key, path), "--save", "ck"], 1, path, model=model(key)), path / "ck" / "step-5"
        return runs[key]

    return get

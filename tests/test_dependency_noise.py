"""The console lines of llamatron's dependencies that concern no user are dropped; their other warnings are kept."""

import logging
import os
import subprocess
import sys
from pathlib import Path

from llamatron.dependency_noise import quiet_dependency_noise

REPO = Path(__file__).resolve().parents[1]


def test_torchaos_native_kernel_lines_are_dropped_and_other_warnings_kept(caplog):
    quiet_dependency_noise()
    with caplog.at_level(logging.WARNING):
        torchao = logging.getLogger("torchao")
        torchao.warning(
            "Failed to load /x/_C_cutlass_90a.abi3.so: Could not load this library: /x/_C_cutlass_90a.abi3.so"
        )
        torchao.warning("Failed to load the quantization config")  # not a native kernel: kept
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"
        )
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to load the quantization config",
        "another pytree warning",
    ]


def test_importing_torchao_as_transformers_does_prints_nothing_after_llamatron_starts():
    """What verify and import-hf printed before any line of their own (torchao, imported by transformers): on this
    CPU machine, two 'Failed to load' lines and torch's enum lines. The first run shows the noise is there to drop."""
    code = "import {quiet}torchao"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", code.format(quiet=q)], capture_output=True, text=True, env=env, timeout=120
        )
        for q in ("", "llamatron.dependency_noise as n; n.quiet_dependency_noise(); import ")
    ]
    noisy, quiet = (r.stderr for r in runs)
    if "Failed to load" not in noisy:  # a machine that loads all of torchao's kernels: nothing to drop
        return
    assert "Failed to load" not in quiet and "is an Enum subclass" not in quiet, quiet

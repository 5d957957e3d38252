"""configs/ and scripts/: every example config validates for its world size and fits its GPUs by the planner;
the launch scripts parse and, run as two local "nodes" on CPU, train."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from layout import free_port

from llamatron.config.settings import config_from_values
from llamatron.planning.plan import predict_peak_memory
from llamatron.training.validate import validate

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / "scripts" / "slurm_train.sbatch", ROOT / "scripts" / "multinode_torchrun.sh"]

# config -> (world size it is written for, GPU memory in bytes; None: CPU)
CONFIGS = {
    "demo-cpu.yaml": (1, None),
    "fp8-parity-350m.yaml": (1, 80e9),
    "fp8-parity-moe.yaml": (1, 80e9),
    "llama-1b-1gpu.yaml": (1, 80e9),
    "llama2-7b-8gpu.yaml": (8, 80e9),
    "llama2-70b-32gpu.yaml": (32, 80e9),
    "falcon-40b-16gpu.yaml": (16, 80e9),
}


def _load(name: str):
    return config_from_values(yaml.safe_load((ROOT / "configs" / name).read_text()))


def test_every_config_is_listed():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_validates_for_its_world_size(name):
    world_size, gpu_memory = CONFIGS[name]
    cfg = _load(name)
    derived = validate(cfg, world_size, cuda_available=gpu_memory is not None)
    assert derived.dp * cfg.parallel.tp * cfg.parallel.pp == world_size
    if gpu_memory is None:
        assert derived.device == "cpu"
        return
    assert derived.dtype_name == "bf16"
    predicted = predict_peak_memory(cfg, world_size)
    assert predicted["total"] <= gpu_memory, f"{name}: planner predicts {predicted['total'] / 1e9:.1f} GB per GPU"


def test_demo_config_holds_the_demos_settings():
    from llamatron.commands.demo import DEMO_DEFAULTS

    values = yaml.safe_load((ROOT / "configs" / "demo-cpu.yaml").read_text())
    assert {
        k: float(values[k]) if isinstance(v, float) else values[k] for k, v in DEMO_DEFAULTS.items() if k != "save"
    } == {k: v for k, v in DEMO_DEFAULTS.items() if k != "save"}
    assert values["save"] != DEMO_DEFAULTS["save"]  # a run of its own, not one of the demo's directories


def test_large_configs_keep_tensor_parallelism_inside_a_node():
    for name in ("llama2-70b-32gpu.yaml", "falcon-40b-16gpu.yaml"):
        cfg = _load(name)
        assert 8 % cfg.parallel.tp == 0 and cfg.parallel.sequence_parallel


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_launches_llamatron(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "-m llamatron train --config" in text and "--rdzv-endpoint" in text
    assert script.stat().st_mode & stat.S_IXUSR


TINY_RUN = [
    "--model",
    "llama-test",
    "--mock-data",
    "--device",
    "cpu",
    "--precision",
    "fp32",
    "--train-steps",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--no-progress",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
]


def _records(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("split") is None]


def _env(**extra) -> dict:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "1", **extra}


def test_multinode_torchrun_script_trains_on_two_local_nodes(tmp_path):
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NNODES="2")
    cmd = [
        "bash",
        str(SCRIPTS[1]),
        str(ROOT / "configs" / "demo-cpu.yaml"),
        *TINY_RUN,
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    ]
    nodes = [
        subprocess.Popen(
            cmd,
            env={**env, "NODE_RANK": str(rank)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (1, 0)
    ]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(log[-3000:] for log in logs)
    records = _records(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2]


def test_slurm_script_trains_with_srun_and_scontrol_stand_ins(tmp_path):
    """The batch script as SLURM would run it on 2 nodes: `srun` starts one agent per node (here both local)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\necho node2\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        "while [[ $1 == -* ]]; do shift; done\n"
        "pids=()\n"
        'for _ in $(seq "$SLURM_NNODES"); do "$@" & pids+=($!); done\n'
        'status=0; for p in "${pids[@]}"; do wait "$p" || status=1; done; exit $status\n'
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = _env(
        SLURM_JOB_NODELIST="localhost,node2", SLURM_NNODES="2", SLURM_JOB_ID="4242", MASTER_PORT=str(free_port())
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        [
            "bash",
            str(SCRIPTS[0]),
            str(ROOT / "configs" / "demo-cpu.yaml"),
            *TINY_RUN,
            "--metrics-file",
            str(tmp_path / "m.jsonl"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rendezvous at localhost:" in proc.stdout
    assert [r["step"] for r in _records(tmp_path / "m.jsonl")] == [1, 2]


def test_check_plan_memory_dry_run_prints_the_prediction():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "check_plan_memory.py"),
            "--model",
            "llama-1b",
            "--seq-length",
            "4096",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--device",
            "cuda",
            "--steps",
            "2",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(proc.stdout)
    assert (
        row["predicted_total_gib"]
        > row["predicted_allocated_gib"]
        > sum(row["breakdown_gib"][k] for k in ("weights", "gradients", "optimizer"))
    )
    assert "--steps" not in row["flags"] and "--dry-run" not in row["flags"] and "--model" in row["flags"]


def test_overlap_ab_benchmark_runs_and_reports_both_modes():
    """benchmarks/overlap_ab.py (issue 5's A/B) on CPU/gloo with a tiny model: both modes timed every round."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(ROOT / "benchmarks" / "overlap_ab.py"),
            "--model",
            "llama-test",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "4",
            "--distributed-optimizer",
            "--device",
            "cpu",
            "--rounds",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["dp"] == 2 and row["dist_opt"] is True
    assert len(row["rounds"]["overlapped"]) == len(row["rounds"]["not_overlapped"]) == 2
    assert row["speedup"] == pytest.approx(row["not_overlapped_ms"] / row["overlapped_ms"])


def test_profile_step_reports_wall_and_kernel_time():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "profile_step.py"),
            "--model",
            "llama-test",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["wall_ms_per_step"] > 0 and result["kernel_ms_per_step"] > 0
    assert result["profiled_wall_ms_per_step"] > 0
    assert abs(sum(result["share"].values()) - 1) < 1e-6
    assert all(len(k) == 3 and k[2] >= 1 for k in result["top_kernels"])  # (name, ms/step, calls/step)
    assert result["idle_ms_per_step"] >= 0 and all(len(g) == 4 for g in result["idle_gaps"])


def test_window_ab_alternates_a_causal_and_a_windowed_engine():
    """benchmarks/window_ab.py (issue 18's ratio): both engines built from one set of flags, only the window
    differs, and each round times a step of each."""
    flags = ["--model", "llama-test", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "window_ab.py"), *flags, "--device", "cpu", "--window", "8"]
        + ["--rounds", "2", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["sliding_window"] == {"causal": None, "window": 8}
    assert len(row["ms"]["causal"]) == len(row["ms"]["window"]) == 2
    assert row["ratio_of_medians"] == pytest.approx(row["median_ms"]["causal"] / row["median_ms"]["window"], rel=1e-3)


def test_profile_step_finds_device_idle_gaps():
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "profile_step.py")
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    spans = [
        ("gemm", 0, 100),
        ("nccl", 50, 130),  # overlapping streams: no gap until 130
        ("adamw", 140, 141),
        ("adamw", 150, 151),
        ("adamw", 160, 161),  # host-bound launches: 9 µs gaps
        ("gemm", 162, 200),
        ("norm", 201, 210),
    ]  # 1 µs apart: launch spacing, not counted
    gaps = profile_step.device_gaps(spans, min_us=2.0)
    assert gaps == [(10, "nccl", "adamw"), (9, "adamw", "adamw"), (9, "adamw", "adamw")]
    assert profile_step.gaps_by_neighbours(gaps, top=5) == [("adamw", "adamw", 18, 2), ("nccl", "adamw", 10, 1)]


def test_profile_step_sync_debug_counts_each_synchronising_stack(monkeypatch):
    """--sync-debug: torch's sync debug mode warns at each synchronising call; the stacks are counted (the mode
    itself needs CUDA, so the warnings are raised by hand here)."""
    import importlib.util
    import warnings

    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "profile_step.py")
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    modes = []
    monkeypatch.setattr(profile_step.torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(profile_step.torch.cuda, "synchronize", lambda: None)

    def item_call():
        warnings.warn("called a synchronizing CUDA operation")

    def step():
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
        )  # the mode's notice when switched on: not a sync
        for _ in range(3):
            item_call()
        warnings.warn("called a synchronizing CUDA operation")

    stacks = profile_step.synchronisations(step)
    assert modes == ["warn", "default"]
    assert sorted(stacks.values()) == [1, 3]  # two call sites
    assert any("item_call" in s for s in stacks) and all("in step" in s for s in stacks)


def test_attention_layout_benchmark_times_each_layout():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "attention_layout.py"),
            "--batch",
            "1",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--seq",
            "32",
            "--head-dim",
            "16",
            "--iters",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [r["layout"] for r in rows] == ["bhsd", "bshd", "packed"] and all(r["ms_fwd_bwd"] > 0 for r in rows)


def test_bench_prints_one_json_row_and_refuses_zero_steps():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable,
        "-m",
        "llamatron",
        "bench",
        "--model",
        "llama-test",
        "--device",
        "cpu",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--warmup",
        "1",
    ]
    proc = subprocess.run(
        [*args, "--steps", "2", "--json", "--save", "ckpt-not-written"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ignoring --save" in proc.stderr and not (ROOT / "ckpt-not-written").exists()
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["tokens_per_sec"] > 0 and row["mbs"] == 1 and row["gbs"] == 2 and row["forward_ms"] > 0
    assert row["precision"] == "fp32" and row["model_overrides"] == {}  # the CPU default; the preset as it is
    assert row["kernels"] == {
        "attention": "auto",
        "swiglu": "torch",
        "rmsnorm": "torch",
        "rope": "torch",
        "cross_entropy": "torch",
        "adamw": "torch",
    }  # on CPU every auto resolves to torch
    proc = subprocess.run([*args, "--steps", "0"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "at least 1 timed step" in proc.stderr


def test_bench_breakdown_is_the_training_step(monkeypatch):
    """bench's instrumented step is train_step itself, timed through its phase hooks: it changes the weights,
    the AdamW state and the fp16 loss scale exactly as training's step does (the warm-up learning rate, the
    loss scaling), and its row has every phase."""
    import torch

    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training import bench
    from llamatron.training.engine import build_engine, train_step

    def engine():
        cfg = config_from_values(
            {
                "model": "llama-test",
                "mock_data": True,
                "device": "cpu",
                "seq_length": 16,
                "micro_batch_size": 1,
                "global_batch_size": 2,
                "precision": "fp16",
                "warmup_steps": 4,
                "train_steps": 8,
            }
        )
        return build_engine(cfg, validate(cfg), build_mesh())

    benched, trained = engine(), engine()
    batch = micro_batches_for_step(MockDataset(benched.model_cfg.vocab_size, 16, 0), 0, 2, 1, 1, 0)
    phases = []

    def recording(e, b, step, on_phase=None):
        return train_step(e, b, step, on_phase=lambda name: (phases.append(name), on_phase(name)))

    monkeypatch.setattr(bench, "train_step", recording)
    times = bench._breakdown(benched, batch, 1)
    train_step(trained, batch, 1)
    assert phases == ["forward_backward", "grad_sync", "optimizer"]
    assert list(times) == ["forward_ms", "backward_ms", "grad_sync_ms", "optimizer_ms"] and times["forward_ms"] > 0
    for a, b in zip(benched.chunks[0].parameters(), trained.chunks[0].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(benched.optimizer.exp_avg, trained.optimizer.exp_avg):
        assert torch.equal(a, b)
    assert benched.loss_scaler.state_dict() == trained.loss_scaler.state_dict()


def test_bench_nproc_per_node_starts_torchrun_and_prints_one_row():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable,
        "-m",
        "llamatron",
        "bench",
        "--model",
        "llama-test",
        "--device",
        "cpu",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--json",
        "--precision",
        "fp32",
    ]

    def row(*extra):
        proc = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(rows) == 1  # printed by rank 0 only
        return rows[0], proc.stderr

    dp2, stderr = row("--nproc-per-node", "2", "--save", "ckpt-not-written")
    assert dp2["gpus"] == 2 and dp2["dp"] == 2
    assert stderr.count("ignoring --save") == 1  # said once, before torchrun starts the ranks
    # the loss is the global one: rank 0 holds half of it under dp 2, none of it as the first pipeline stage
    single, _ = row()
    pp2, _ = row("--nproc-per-node", "2", "--pp", "2")
    assert dp2["loss"] == pytest.approx(single["loss"], rel=1e-4) and pp2["loss"] == pytest.approx(
        single["loss"], rel=1e-4
    )


def test_version_names_llamatron_and_torch():
    proc = subprocess.run([sys.executable, "-m", "llamatron", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("llamatron 0.") and "torch 2." in proc.stdout


def test_bench_table_names_what_it_measured_on_cpu_and_gpu():
    from llamatron.training.bench import format_row

    row = {
        "model": "m",
        "tp": 1,
        "pp": 1,
        "vpp": 1,
        "dp": 1,
        "sp": False,
        "dist_opt": False,
        "recompute": "none",
        "tokens_per_sec": 10.0,
        "tflops_per_gpu": 0.0,
        "mfu": None,
        "peak_mem_gib": 1.0,
        "step_ms": 5.0,
        "bubble_frac": 0.0,
        "forward_ms": 1.0,
    }
    cpu = format_row({**row, "device": "cpu"}).splitlines()[0]
    gpu = format_row({**row, "device": "NVIDIA H200"}).splitlines()[0]
    assert "tok/s/rank" in cpu and "RSS GiB" in cpu  # a process's resident memory, not GPU memory
    assert "tok/s/gpu" in gpu and "mem GiB" in gpu


def test_bench_table_shows_small_tflops_and_model_overrides():
    from llamatron.training.bench import format_row

    row = {
        "model": "llama-test",
        "tp": 1,
        "pp": 1,
        "vpp": 1,
        "dp": 1,
        "sp": False,
        "dist_opt": False,
        "recompute": "none",
        "tokens_per_sec": 10.0,
        "tflops_per_gpu": 0.0123,
        "mfu": None,
        "peak_mem_gib": 1.0,
        "step_ms": 5.0,
        "bubble_frac": 0.0,
        "device": "cpu",
    }
    plain = format_row(row).splitlines()
    assert len(plain) == 2 and " 0.0123 " in plain[1] and "llama-test " in plain[1]  # not rounded to 0.0
    changed = format_row({**row, "tflops_per_gpu": 412.345, "model_overrides": {"num_layers": 3}}).splitlines()
    assert "llama-test* " in changed[1] and " 412.3 " in changed[1]
    assert changed[2] == "* model_overrides: num_layers=3"

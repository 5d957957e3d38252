"""The step simulator's mechanics (llamatron/planning/simulator/): the pipeline schedules against their closed forms,
llamatron's data-parallel overlap per bucket, the hardware profiles and their checks, MoE, and `plan` using it."""

import builtins
import json

import pytest
from plan_layouts import planned

from llamatron.cli import main
from llamatron.errors import ConfigError
from llamatron.models import get_preset
from llamatron.models.inventory import active_params, flops_per_token, num_params
from llamatron.planning.plan import Precision
from llamatron.planning.simulator.costs import Shape, StepOptions
from llamatron.planning.simulator.evaluate import SimSettings, simulate_layout
from llamatron.planning.simulator.hardware import resolve_hardware
from llamatron.planning.simulator.step import simulate_step
from llamatron.planning.simulator.timeline import ChunkDurations, run_pipeline


def _span(events):
    return max(e.end for e in events)


# ---- pipeline schedules ---------------------------------------------------------------------------------------


def test_1f1b_takes_m_plus_p_minus_1_slots_interleaving_and_zero_bubble_take_less():
    pp, m = 4, 8
    one = run_pipeline(pp, 1, m, [ChunkDurations(1.0, 2.0, 0.0)] * pp, p2p=0.0)
    assert _span(one) == pytest.approx((m + pp - 1) * 3.0)  # the 1F1B bubble: (p-1)(F+B)
    interleaved = run_pipeline(pp, 2, m, [ChunkDurations(0.5, 1.0, 0.0)] * (2 * pp), p2p=0.0)
    assert m * 3.0 < _span(interleaved) < _span(one)  # (p-1)(F+B)/vpp
    zb = run_pipeline(pp, 1, m, [ChunkDurations(1.0, 1.0, 1.0)] * pp, p2p=0.0, zero_bubble=True)
    assert _span(zb) == pytest.approx(m * 3.0 + (pp - 1) * (1.0 + 1.0 - 1.0))  # ZB-H1: (p-1)(F+B-W)
    assert sum(e.kind == "W" for e in zb) == pp * m


def test_point_to_point_transfers_delay_the_pipeline():
    chunks = [ChunkDurations(1.0, 2.0, 0.0)] * 2
    assert _span(run_pipeline(2, 1, 4, chunks, p2p=0.5)) > _span(run_pipeline(2, 1, 4, chunks, p2p=0.0))


# ---- data parallelism -----------------------------------------------------------------------------------------

MODEL = get_preset("llama-1b")
SLOW = resolve_hardware("h100-sxm", inter_node_bandwidth=5.0)  # dp across nodes at 5 GB/s per GPU


def _step(overlap, hw=SLOW, dist_opt=True, **shape):
    s = Shape(dp=2, micro_batch_size=4, seq_length=4096, distributed_optimizer=dist_opt, **shape)
    opt = StepOptions(micro_batches=2, overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    one_per_node = resolve_hardware("h100-sxm", inter_node_bandwidth=5.0, gpus_per_node=1) if hw is SLOW else hw
    return simulate_step(MODEL, s, one_per_node, opt)


def test_with_overlap_every_bucket_but_the_last_is_reduced_before_backward_ends():
    for overlap in (True, False):
        r = _step(overlap)
        backward_end = max(e.end for e in r.events if e.kind == "B")
        reduces = sorted((e for e in r.events if e.kind == "dp-rs"), key=lambda e: e.start)
        assert len(reduces) > 3  # llama-1b's 40M-element buckets
        if overlap:  # issued as its last gradient arrives (it may then wait for the stream)
            assert all(e.issue_time < backward_end for e in reduces[:-1])
        else:
            assert all(e.issue_time >= backward_end for e in reduces)


def test_with_overlap_the_first_forward_waits_for_the_gathers_layer_by_layer():
    on, off = _step(True), _step(False)
    gathers = sorted((e for e in on.events if e.kind == "dp-ag"), key=lambda e: e.start)
    first, second = (e for e in on.events if e.kind == "F")
    assert gathers[0].end < first.end and gathers[-1].end <= first.end  # waited for inside it, one by one
    assert first.end - first.start > second.end - second.start  # the next forward does not wait
    assert on.parts["gather_wait"] > 0 and on.parts["dp_gather_blocking"] == 0
    assert (
        off.parts["gather_wait"] == pytest.approx(0, abs=1e-9) and off.parts["dp_gather_blocking"] > 0
    )  # after the optimizer instead


def test_the_simulator_says_how_much_traffic_overlap_hides_on_a_network():
    lay = planned(1, 1, 1, 16, False, True, "none", 4, 64)
    fast = simulate_layout(MODEL, lay, 4096, resolve_hardware("h100-sxm", network="8x400Gb-ndr")).to_dict()
    slow = simulate_layout(MODEL, lay, 4096, resolve_hardware("h100-sxm", network="1x100Gb-eth")).to_dict()
    for d in (fast, slow):
        dp = d["data_parallel"]
        assert dp["exposed_with_overlap"] < dp["exposed_without_overlap"]
        assert dp["hidden_by_overlap"] == pytest.approx(dp["exposed_without_overlap"] - dp["exposed_with_overlap"])
    assert slow["data_parallel"]["comm_seconds"] > 5 * fast["data_parallel"]["comm_seconds"]
    assert slow["data_parallel"]["hidden_by_overlap"] > fast["data_parallel"]["hidden_by_overlap"]


def test_mfu_is_the_flops_contract_on_the_gpus_datasheet_peak():
    r = simulate_layout(
        MODEL, planned(1, 1, 1, 1, False, False, "none", 8, 8), 4096, resolve_hardware("a100-80gb")
    ).result
    assert r.mfu == pytest.approx(r.tokens_per_sec_per_gpu * flops_per_token(MODEL, 4096) / 312e12)
    h100 = simulate_layout(MODEL, planned(1, 1, 1, 1, False, False, "none", 8, 8), 4096, resolve_hardware("h100-sxm"))
    assert h100.result.tokens_per_sec_per_gpu > 2 * r.tokens_per_sec_per_gpu


# ---- hardware profiles ----------------------------------------------------------------------------------------


def test_a_hardware_file_adds_a_gpu_and_bad_ones_say_what_is_wrong(tmp_path):
    good = tmp_path / "hw.yaml"
    good.write_text(
        "gpus:\n  b200:\n    peak_tflops: 2250\n    memory_gb: 192\n    hbm_tbps: 8\n    link: nvlink5\n"
        "    gpus_per_node: 8\nlinks:\n  nvlink5: {bandwidth_gbps: 900, latency_us: 8}\n"
    )
    hw = resolve_hardware("b200", network="8x400Gb-ndr", hardware_file=good)
    assert hw.gpu.peak_flops == 2250e12 and hw.link.bandwidth == 900e9
    assert resolve_hardware("h100-sxm", network="8x200Gb-hdr").network.node_bandwidth == pytest.approx(200e9)
    assert resolve_hardware("h100-sxm", inter_node_bandwidth=25).nic_bandwidth_per_gpu() == pytest.approx(25e9)
    gpu = "gpus:\n  x: {{peak_tflops: {}, memory_gb: 1, hbm_tbps: 1, link: {}, gpus_per_node: 8{}}}\n"
    cases = {
        gpu.format(1, "nvlink4", ", fast: 1"): "unknown key",
        gpu.format(-1, "nvlink4", ""): "positive number",
        gpu.format(1, "nvlink9", ""): "is not a link",
        "gpus:\n  x: {peak_tflops: 1}\n": "missing",
        "gpus: !!python/object/apply:os.system ['echo hi']\n": "not valid YAML",
        "[1, 2]\n": "must hold a mapping",
    }
    for text, words in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=words) as e:
            resolve_hardware("x", hardware_file=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not a known GPU"):
        resolve_hardware("h9000")
    with pytest.raises(ConfigError, match="NICSxRATEGb"):
        resolve_hardware("h100-sxm", network="fast")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"network": "0x400Gb"}, "1 to 1024 NICs of a positive rate"),  # issue 39: a division by zero
        ({"network": "8x0Gb"}, "1 to 1024 NICs of a positive rate"),
        ({"inter_node_bandwidth": float("inf")}, "--inter-node-bandwidth inf must be a positive number"),
        ({"inter_node_latency_us": float("nan")}, "--inter-node-latency nan must be a finite number"),
    ],
)
def test_networks_that_cannot_be_are_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words) as e:
        resolve_hardware("h100-sxm", **kwargs)
    assert "\n" not in str(e.value)


def test_hardware_files_with_an_infinite_gpu_or_not_utf8_are_refused(tmp_path):
    """issue 39: an infinite peak planned an infinitely fast GPU; bytes that are not UTF-8 ended in a traceback."""
    infinite = tmp_path / "inf.yaml"
    infinite.write_text("gpus:\n  x: {peak_tflops: .inf, memory_gb: 80, hbm_tbps: 3, link: nvlink4, gpus_per_node: 8}")
    with pytest.raises(ConfigError, match=r"peak_tflops must be a positive number \(at most 1e\+09\), got inf"):
        resolve_hardware("x", hardware_file=infinite)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe gpus: {}")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        resolve_hardware("h100-sxm", hardware_file=binary)


# ---- MoE and the command --------------------------------------------------------------------------------------


def plan_json(argv, capsys):
    try:
        main(["plan", *argv, "--json"])
    except SystemExit as e:
        assert e.code in (0, 1, None)
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_mixture_of_experts_shows_active_parameters_expert_memory_and_all_to_all(capsys):
    base = ["--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--pp", "4", "--seq-length", "4096"]
    got = {ep: plan_json([*base, "--ep", str(ep)], capsys) for ep in (1, 4, 8)}
    sim = got[8]["simulation"]
    model = get_preset("mixtral-8x7b")
    assert sim["parameters"] == num_params(model) > 3 * sim["active_parameters"] == 3 * active_params(model)
    assert sim["mfu"] == pytest.approx(sim["tokens_per_sec_per_gpu"] * flops_per_token(model, 4096) / 989.4e12)
    moe4, moe8 = got[4]["simulation"]["moe"], sim["moe"]
    assert moe8["experts_per_rank"] == 1 and moe8["expert_weights_gb_per_rank"] == pytest.approx(
        moe4["expert_weights_gb_per_rank"] / 2
    )
    assert moe8["all_to_all_gb_per_rank_and_step"] > 0 and moe8["all_to_all_seconds_exposed"] > 0
    assert (
        "all_to_all_gb_per_rank_and_step" not in got[1]["simulation"]["moe"]
        or got[1]["simulation"]["moe"]["all_to_all_gb_per_rank_and_step"] == 0
    )
    assert got[8]["memory_gb"]["weights"] < got[1]["memory_gb"]["weights"] / 3


def test_plan_simulates_any_shape_on_named_hardware(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: llama2-7b\nmodel_overrides: {num_layers: 16}\nseq_length: 4096\nglobal_batch_size: 64\n")
    argv = [
        "--config",
        str(config),
        "--gpus",
        "64",
        "--gpu",
        "a100-80gb",
        "--network",
        "8x200Gb-hdr",
        "--tp",
        "8",
        "--pp",
        "4",
    ]
    got = plan_json([*argv, "--train-tokens", "1e12", "--price-per-gpu-hour", "2"], capsys)
    sim = got["simulation"]
    assert got["tokens_per_sec_per_gpu"] == sim["tokens_per_sec_per_gpu"] > 0
    assert got["tflops_per_gpu"] == pytest.approx(sim["mfu"] * 312)
    assert "a100-80gb" in sim["hardware"] and "8x200Gb-hdr" in sim["hardware"]
    assert sim["exposed_comm_seconds"]["tp"] > 0 and sim["exposed_comm_seconds"]["pipeline_bubble_and_p2p"] > 0
    train = sim["train"]
    assert train["gpu_hours"] == pytest.approx(1e12 / sim["tokens_per_sec_per_gpu"] / 3600)
    assert train["cost"] == pytest.approx(2 * train["gpu_hours"]) and train["days"] == pytest.approx(
        train["gpu_hours"] / 64 / 24
    )
    png = tmp_path / "step.png"
    with pytest.raises(SystemExit):
        main(["plan", *argv, "--explain", "--explain-png", str(png)])
    out = capsys.readouterr().out
    assert "pp   3 compute |" in out and "overlap hides" in out and png.read_bytes()[:4] == b"\x89PNG"


def test_explain_png_without_matplotlib_is_one_clear_line(monkeypatch, tmp_path, capsys):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama-1b", "--gpus", "1", "--tp", "1", "--explain-png", str(tmp_path / "x.png")])
    assert e.value.code == 2 and "needs matplotlib" in capsys.readouterr().err


def test_zero_bubble_gains_on_a_pipeline_and_keeps_1f1b_memory(capsys):
    model = get_preset("llama2-70b")
    lay = planned(8, 8, 1, 8, True, True, "none", 1, 512)
    hw = resolve_hardware("h100-sxm", network="8x400Gb-ndr")
    one = simulate_layout(model, lay, 4096, hw, Precision(), SimSettings(schedule="1f1b")).result
    zb = simulate_layout(model, lay, 4096, hw, Precision(), SimSettings(schedule="zb-h1")).result
    assert zb.parts["bubble"] < 0.8 * one.parts["bubble"] and zb.step_seconds < one.step_seconds
    with pytest.raises(ConfigError, match="vpp 1"):
        from llamatron.commands import plan_simulate

        class Args:
            pipeline_schedule = "zb-h1"

        plan_simulate.simulate(
            Args(),
            model,
            type("P", (), {"layout": planned(8, 8, 2, 8, True, True, "none", 1, 512)})(),
            4096,
            hw,
            Precision(),
        )


def test_attention_at_head_dim_128_runs_at_its_measured_factor_and_an_assumed_gpu_keeps_its_figure():
    """RESULTS.md run 11: wider heads do more work per tile. Measured on the H200 (it scales to the H100);
    an A100's attention figure is an assumption that already covers head dims, so it is left alone."""
    from llamatron.planning.simulator.calibration import load_calibration

    cal = load_calibration()
    for backend, factor in (("cudnn", 1.25), ("fa4", 1.145), ("auto", 1.25)):
        at64 = cal.attention("h200", backend, 8192, 64)
        assert cal.attention("h200", backend, 8192, 128) == pytest.approx(at64 * factor)
        assert cal.attention("h200", backend, 8192, 96) == pytest.approx(at64 * (1 + (factor - 1) / 2))
        assert cal.attention("h200", backend, 8192, 256) == pytest.approx(at64 * factor)
    assert cal.attention("a100-80gb", "cudnn", 4096, 128) == cal.attention("a100-80gb", "cudnn", 4096, 64)


def test_overlapped_gradient_buckets_cost_the_compute_at_most_their_own_time():
    """Llama 2 7B over 8 H100s (dp 8, NVLink): the buckets' collectives move more than the contention bandwidth's
    bytes a second, so their bytes alone would charge the compute more than the time they run beside it; the
    charge is bounded by their time (an overlapped collective never costs more than running it alone)."""
    lay = planned(1, 1, 1, 8, False, True, "none", 1, 64)
    sim = simulate_layout(get_preset("llama2-7b"), lay, 4096, resolve_hardware("h100-sxm"))
    assert 0 < sim.result.parts["contention"] <= sim.result.dp_comm_seconds


def test_overlapped_tensor_parallel_collectives_cost_the_compute_at_most_the_time_they_run_beside_it():
    """tp 2 with sequence parallelism, Llama 2 7B: llamatron's two backward collectives beside the weight-gradient
    GEMMs, and Megatron-core's userbuffers under every GEMM. Over NVLink they hide, and their bytes / the contention
    bandwidth is the charge. Over PCIe they outlast the GEMMs: charged by their bytes alone the compute would pay
    for time they run on their own; the charge is the time beside the GEMMs at the collectives' byte rate, never
    more than that time, and the userbuffers' SM share only while a GEMM runs."""
    import dataclasses

    from llamatron.planning.simulator.calibration import load_calibration
    from llamatron.planning.simulator.costs import Costs

    model, cal, shape = get_preset("llama2-7b"), load_calibration(), Shape(tp=2, sequence_parallel=True)
    nvlink = Costs(model, shape, resolve_hardware("h100-sxm"), cal)
    bytes_alone = 2 * nvlink.tp_bytes() / cal.contention_bandwidth
    assert nvlink.layer().backward_input.parts["contention"] == pytest.approx(bytes_alone)
    pcie = resolve_hardware("h100-pcie")
    costs = Costs(model, shape, pcie, cal)
    gemm, one = costs.gemm_forward(), costs.tp_collective()
    assert 2 * one > 1.5 * gemm  # the two outlast the GEMMs they run beside
    charged = costs.layer().backward_input.parts["contention"]
    assert charged == pytest.approx(gemm * costs.tp_bytes() / one / cal.contention_bandwidth)
    slow = Costs(model, shape, pcie, dataclasses.replace(cal, contention_bandwidth=1e6))  # bytes alone: seconds
    assert slow.layer().backward_input.parts["contention"] == pytest.approx(gemm)
    userbuffers = Costs(model, dataclasses.replace(shape, tp_overlap_all=True), pcie, cal).layer()
    share = cal.tp_userbuffers_sm_share
    assert userbuffers.forward.parts["contention"] == pytest.approx(gemm * share)  # four collectives, one GEMM's time
    assert userbuffers.backward_input.parts["contention"] == pytest.approx(2 * gemm * share)

"""Prints docs/simulator.md's tables of issue 38: every row of published_runs.yaml predicted against its published
figure, and the large layouts the published runs used simulated with llamatron's own mechanisms and with
Megatron-core's (userbuffers tensor-parallel overlap, fused gradient accumulation). Run it after changing the
simulator or its calibration and paste the rows into the doc.

usage: python scripts/simulator_published_table.py   (about half a minute on two cores)
"""

from __future__ import annotations

from llamatron.errors import ConfigError
from llamatron.planning.simulator.published_runs import predict, published_runs


def layout_text(r: dict) -> str:
    pp = f"pp {r['pp']}" + (f" x vpp {r['vpp']}" if r["vpp"] > 1 else "")
    dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
    parts = [f"tp {r['tp']}", pp, f"dp {dp}"] + [f"{k} {r[k]}" for k in ("cp", "ep") if r[k] > 1]
    parts += ["etp 1"] if r.get("etp") == 1 and r["tp"] > 1 else []  # Megatron's ep counts these tp ranks
    return ", ".join(parts + [f"mb {r['micro_batch_size']}", f"gbs {r['global_batch_size']}", f"seq {r['seq_length']}"])


def published_table() -> None:
    print("| run | GPUs | layout | precision | published | predicted | error | held out | checked |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in published_runs():
        try:
            p = predict(r)
        except ConfigError as e:  # a left-out row whose layout the simulator cannot lay out
            row = f"| {r['name']} | {r['gpus']} | {layout_text(r)} | {r['precision']} |"
            print(f"{row} | not simulated: {e} | | | no |")
            continue
        unit = "tok/s" if p.unit.startswith("tokens") else "TFLOP/s"
        checked = "no: " + r["excluded"].split(":")[0].split(" (")[0] if r.get("excluded") else "yes"
        print(
            f"| {r['name']} | {r['gpus']} | {layout_text(r)} | {r['precision']} | {p.published:,.0f} {unit} | "
            f"{p.predicted:,.0f} | {p.error:+.1%} | {'yes' if r.get('held_out') else ''} | {checked} |"
        )


def mechanisms_table() -> None:
    """The same published layouts, llamatron's mechanisms against Megatron-core's."""
    print("| run | layout | llamatron's mechanisms | Megatron-core's | published |")
    print("|---|---|---|---|---|")
    for r in published_runs():
        if r.get("excluded") or r["tp"] == 1 or r.get("tp_overlap") != "all":  # Megatron-core's tp rows
            continue
        ours = predict({**r, "tp_overlap": None, "source": "llamatron"})
        theirs = predict(r)
        print(
            f"| {r['name']} | {layout_text(r)} | {ours.predicted:,.0f} ({ours.sim.result.mfu:.1%} MFU) | "
            f"{theirs.predicted:,.0f} ({theirs.sim.result.mfu:.1%}) | {theirs.published:,.0f} |"
        )


def _split(chunks: int, layers: int = 126) -> str:
    """126 layers over `chunks` chunks, the first and the last one layer short (the embedding and the loss)."""
    per = (layers + 2) // chunks
    return ",".join(str(n) for n in [per - 1] + [per] * (chunks - 2) + [per - 1])


def llama405_table() -> None:
    """Llama 3.1 405B, bf16, on the layouts its published runs used, with each framework's mechanisms."""
    base = {"model": "llama3.1-405b", "precision": "bf16", "ep": 1, "micro_batch_size": 1, "seq_length": 8192}
    layouts = [
        {"gpus": 1024, "tp": 8, "pp": 8, "vpp": 8, "cp": 2, "global_batch_size": 512},
        {"gpus": 8192, "tp": 8, "pp": 16, "vpp": 1, "cp": 1, "global_batch_size": 2048},
        {"gpus": 8192, "tp": 8, "pp": 16, "vpp": 2, "cp": 1, "global_batch_size": 2048},
        {"gpus": 8192, "tp": 8, "pp": 16, "vpp": 4, "cp": 1, "global_batch_size": 2048},
        {"gpus": 8192, "tp": 8, "pp": 16, "vpp": 8, "cp": 1, "global_batch_size": 2048},  # the Llama 3 paper's
    ]
    print("| GPUs | layout | llamatron's mechanisms: tokens/s/GPU, MFU | Megatron-core's |")
    print("|---|---|---|---|")
    for lay in layouts:
        run = {**base, **lay, "pp_layers": _split(lay["pp"] * lay["vpp"]), "tokens_per_sec_per_gpu": 1}
        ours = predict({**run, "source": "llamatron"}).sim.result
        theirs = predict({**run, "source": "megatron", "tp_overlap": "all"}).sim.result
        print(
            f"| {lay['gpus']} | {layout_text(run)} | {ours.tokens_per_sec_per_gpu:,.0f}, {ours.mfu:.1%} | "
            f"{theirs.tokens_per_sec_per_gpu:,.0f}, {theirs.mfu:.1%} |"
        )


if __name__ == "__main__":
    published_table()
    print()
    mechanisms_table()
    print()
    llama405_table()

"""The simulated step in words (`plan --explain`: the breakdown and a text timeline per pipeline rank) and as
a Gantt chart (`--explain-png FILE`, with matplotlib if it is installed)."""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError
from ...models.inventory import active_params, num_params
from .advice import suggestions
from .evaluate import Simulation
from .timeline import Event

WIDTH = 100
_GLYPH = {"F": "F", "B": "B", "W": "w", "dp-ag": "g", "dp-rs": "r", "opt": "o"}
_PARTS = [
    ("compute", "compute (GEMMs, attention, elementwise, loss, gradient accumulation)"),
    ("tp", "tensor-parallel collectives, exposed"),
    ("cp", "context-parallel K/V gathers, exposed"),
    ("ep", "expert-parallel all-to-alls, exposed"),
    ("fsdp", "--fsdp's per-layer all-gathers and reduce-scatters (and hybrid all-reduces), exposed"),
    ("contention", "compute slowed by overlapped collectives"),
    ("gather_wait", "first forwards waiting for parameter all-gathers"),
    ("bubble", "pipeline bubble and point-to-point waits"),
    ("dp_exposed", "gradient reduction after the last backward"),
    ("dp_gather_blocking", "parameter all-gather after the optimizer (not overlapped)"),
    ("optimizer", "optimizer step"),
    ("routing_pass", "global-batch load balancing's routing pass (every micro-batch forward once more, no gradient)"),
    ("idle", "GPU idle between kernels (host launches, synchronisation)"),
]


def _row(events: list[Event], span: float, kinds: set[str]) -> str:
    cells = ["."] * WIDTH
    for e in events:
        if e.kind not in kinds or e.end <= e.start:
            continue
        a, b = int(e.start / span * WIDTH), max(int(e.start / span * WIDTH) + 1, int(e.end / span * WIDTH))
        for i in range(a, min(b, WIDTH)):
            cells[i] = _GLYPH[e.kind]
    return "".join(cells)


def explain_text(sim: Simulation) -> str:
    r, lay = sim.result, sim.layout
    on, off = sim.with_overlap, sim.without_overlap
    lines = [
        f"simulated step: {num_params(sim.model) / 1e9:.1f}B parameters ({active_params(sim.model) / 1e9:.1f}B "
        f"active), {lay.label}, vpp {lay.vpp}, micro-batch {lay.micro_batch_size} x {lay.micro_batches}, "
        f"recompute {lay.recompute_label}, schedule {sim.settings.schedule}, "
        f"overlap {'on' if sim.settings.overlap else 'off'}",
        f"hardware: {sim.hardware.describe()}",
        f"step {r.step_seconds * 1e3:,.1f} ms: {r.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, MFU {r.mfu:.1%}",
        "where the step goes (the pipeline rank that finishes last):",
    ]
    for key, what in _PARTS:
        seconds = r.parts.get(key, 0.0)
        if abs(seconds) >= 5e-5:
            lines.append(f"  {seconds * 1e3:10.1f} ms  {seconds / r.step_seconds:6.1%}  {what}")
    lines.append(
        f"data-parallel traffic: {on.dp_comm_seconds * 1e3:,.1f} ms of collectives per step; exposed "
        f"{on.dp_exposed_seconds * 1e3:,.1f} ms with overlap, {off.dp_exposed_seconds * 1e3:,.1f} ms without "
        f"(overlap hides {(off.dp_exposed_seconds - on.dp_exposed_seconds) * 1e3:,.1f} ms; step "
        f"{on.step_seconds * 1e3:,.1f} vs {off.step_seconds * 1e3:,.1f} ms)"
    )
    if sim.fsdp is not None:
        f = sim.fsdp
        hybrid = f", {f['all_reduce_gb']:,.1f} GB all-reduced over the hybrid groups (not overlapped)"
        lines.append(
            f"--fsdp traffic per rank and step: {f['all_gather_gb']:,.1f} GB all-gathered (weights, forward"
            f"{'' if lay.fsdp_keep_params else ' and backward'}), {f['reduce_scatter_gb']:,.1f} GB "
            f"reduce-scattered (gradients, every micro-batch){hybrid if f['all_reduce_gb'] else ''}; "
            f"{f['exposed_seconds'] * 1e3:,.1f} ms exposed"
        )
    lines.append("what would reduce it (each change simulated on the same hardware):")
    lines.extend(suggestions(sim))
    span = max(e.end for e in r.events)
    lines.append(
        f"timeline, 0 to {span * 1e3:,.1f} ms, {WIDTH} columns (F forward, B backward, w weight gradients, "
        "g parameter all-gather, r gradient reduce-scatter/all-reduce, o optimizer, . idle):"
    )
    for rank in range(lay.pp):
        mine = [e for e in r.events if e.rank == rank]
        lines.append(f"  pp {rank:>3} compute |{_row(mine, span, {'F', 'B', 'W', 'opt'})}|")
        lines.append(f"         data-par |{_row(mine, span, {'dp-ag', 'dp-rs'})}|")
    return "\n".join(lines)


def explain_png(sim: Simulation, path: str | Path) -> None:
    """A Gantt chart of the simulated step: one row of compute and one of data-parallel traffic per rank."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--explain-png needs matplotlib: pip install -e '.[plot]' (or use --explain for text)"
        ) from None
    colours = {
        "F": "tab:blue",
        "B": "tab:orange",
        "W": "tab:green",
        "dp-ag": "tab:purple",
        "dp-rs": "tab:red",
        "opt": "tab:gray",
    }
    pp = sim.layout.pp
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * pp))
    for e in sim.result.events:
        y = 2 * (pp - 1 - e.rank) + (0 if e.kind in ("dp-ag", "dp-rs") else 1)
        ax.broken_barh([(e.start * 1e3, (e.end - e.start) * 1e3)], (y, 0.8), color=colours[e.kind], ec="white", lw=0.3)
    ax.set_yticks([2 * (pp - 1 - r) + o + 0.4 for r in range(pp) for o in (1, 0)])
    ax.set_yticklabels([f"pp {r} {w}" for r in range(pp) for w in ("compute", "data-parallel")])
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    names = ["forward", "backward", "weight grad", "all-gather", "reduce", "optimizer"]
    ax.legend(handles, names, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    ax.set_title(
        f"{sim.layout.label}, {sim.result.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, MFU {sim.result.mfu:.1%}"
    )
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise ConfigError(f"--explain-png {path}: cannot write it ({e.strerror})") from None
    finally:
        plt.close(fig)

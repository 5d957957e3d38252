"""What would make a simulated step faster (`plan --explain`): for each part of the step that costs more than a
few percent, the change that attacks it, simulated on the same hardware, with the tokens/s it would give.
Memory is not re-checked here: a suggestion that changes the layout is to be planned again with `plan`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from ...errors import ConfigError
from ...parallel.schedules import check_micro_batches
from ..plan import Layout
from .evaluate import Simulation, simulate_layout

SIGNIFICANT = 0.03  # a part of the step worth a suggestion
Change = tuple[str, Callable[[Simulation], Simulation]]


def _with(sim: Simulation, layout: Layout | None = None, **settings: object) -> Simulation:
    lay = layout or sim.layout
    if lay.global_batch_size % (lay.micro_batch_size * lay.dp):
        raise ConfigError(
            f"global batch {lay.global_batch_size} is not a multiple of micro-batch x dp = "
            f"{lay.micro_batch_size * lay.dp}"
        )
    check_micro_batches(lay.micro_batches, lay.pp, lay.vpp)  # the trainer's own rule for the schedule
    return simulate_layout(
        sim.model,
        lay,
        sim.seq_length,
        sim.hardware,
        sim.precision,
        replace(sim.settings, **settings),  # type: ignore[arg-type]
    )


def _changes(sim: Simulation, part: str) -> Iterator[Change]:
    """The changes that attack `part` of the step, each as (what to do, how to simulate it)."""
    lay = sim.layout
    if part == "bubble" and lay.pp > 1:
        yield f"interleave: --vpp {lay.vpp * 2}", lambda s: _with(s, replace(lay, vpp=lay.vpp * 2))
        yield (
            f"twice the micro-batches per step: --global-batch-size {lay.global_batch_size * 2}",
            lambda s: _with(s, replace(lay, global_batch_size=lay.global_batch_size * 2)),
        )
        if lay.pp % 2 == 0:
            yield (
                f"half the pipeline, twice the data parallelism: --pp {lay.pp // 2}",
                lambda s: _with(s, replace(lay, pp=lay.pp // 2, dp=lay.dp * 2)),
            )
    if part == "tp" and lay.tp > 1:
        yield (
            "every tp collective under its GEMM, forward too (Megatron-core's userbuffers; llamatron overlaps only "
            "the backward's two: not available, predicted)",
            lambda s: _with(s, tp_overlap_all=True),
        )
        yield (
            f"half the tensor parallelism, twice the data parallelism: --tp {lay.tp // 2}",
            lambda s: _with(s, replace(lay, tp=lay.tp // 2, dp=lay.dp * 2, sequence_parallel=lay.tp > 2)),
        )
    if part == "cp" and lay.cp > 1:
        yield (
            f"--cp {lay.cp // 2} (more data parallelism)",
            lambda s: _with(s, replace(lay, cp=lay.cp // 2, dp=lay.dp * 2)),
        )
    if part == "ep" and lay.ep > 1:
        yield (
            f"--ep {lay.ep // 2} (fewer experts' tokens leave the rank)",
            lambda s: _with(s, replace(lay, ep=lay.ep // 2)),
        )
    if part in ("dp_exposed", "gather_wait", "dp_gather_blocking"):
        if not sim.settings.overlap:
            yield "--overlap (reduce and gather beside compute)", lambda s: _with(s, overlap=True)
        if sim.settings.grad_reduce_dtype == "fp32":
            yield "--grad-reduce-dtype bf16 (half the bytes)", lambda s: _with(s, grad_reduce_dtype="bf16")
    if part == "optimizer":
        yield (
            f"more tokens per optimizer step: --global-batch-size {lay.global_batch_size * 2}",
            lambda s: _with(s, replace(lay, global_batch_size=lay.global_batch_size * 2)),
        )
    if part == "compute" and lay.recompute != "none":
        yield "--recompute none (if it fits)", lambda s: _with(s, replace(lay, recompute="none", recompute_layers=None))


def suggestions(sim: Simulation) -> list[str]:
    """Lines for `plan --explain`: per significant part, each change and its simulated tokens/s per GPU."""
    r = sim.result
    base = r.tokens_per_sec_per_gpu
    parts = dict(r.parts, dp_exposed=r.parts.get("dp_exposed", 0.0))
    lines = []
    for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        if seconds / r.step_seconds < SIGNIFICANT:
            continue
        for what, simulate in _changes(sim, part):
            try:
                other = simulate(sim).result.tokens_per_sec_per_gpu
            except ConfigError as e:  # the change does not fit this model (layers, heads, batch)
                lines.append(f"  {part} ({seconds / r.step_seconds:.0%}): {what}: not possible here ({e})")
                continue
            lines.append(
                f"  {part} ({seconds / r.step_seconds:.0%}): {what}: {other:,.0f} tokens/s per GPU "
                f"({other / base - 1:+.1%}; memory not re-checked)"
            )
    return lines or ["  no part other than compute takes more than 3% of the step"]

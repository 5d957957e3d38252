"""`llamatron plan`'s ranking: of the layouts a search found to fit, the fastest by the step simulator.

Simulating every layout would take about a tenth of a second each, and a 64-GPU search finds hundreds. Instead
each layout gets an upper bound of its simulated tokens/s (evaluate.LayoutSteps.bound: the simulator's own
costs without the timeline, under a millisecond), the layouts are simulated in the order of their bounds, and
the simulation stops once the next bound is below the `top`-th simulated speed: no layout left could enter the
top. So the top is what simulating them all would list, and only a few more than `top` layouts are simulated
where the bounds are tight (within ~15% of the simulated speed: they leave out the pipeline's drain and the
data-parallel collectives). evaluate.simulate_layout, given a ranked step, adds the same step with the
data-parallel overlap the other way for a layout shown in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...models import ModelConfig
from ..plan import Plan, Precision, Speed
from .evaluate import LayoutSteps, SimSettings
from .hardware import Hardware
from .step import StepResult


@dataclass
class Ranked:
    top: list[tuple[Plan, StepResult]]  # fastest first; each Plan's speed is its simulated step's
    simulated: int  # layouts simulated to find them


def simulated_plan(p: Plan, r: StepResult) -> Plan:
    """`p` with the simulated step's speed (the pipeline's ideal bubble share kept: it describes the schedule)."""
    return Plan(p.layout, p.memory, Speed(r.step_seconds, r.tokens_per_sec_per_gpu, r.mfu, p.speed.bubble, r.parts))


def rank_by_simulation(
    model: ModelConfig,
    plans: list[Plan],
    seq_length: int,
    hw: Hardware,
    precision: Precision,
    settings: SimSettings,
    top: int,
) -> Ranked:
    """The `top` fastest of `plans` by the step simulator (ties: the smaller memory first, then the given order)."""
    steps = LayoutSteps(model, seq_length, hw, precision, settings)
    bounds = [steps.bound(p.layout) for p in plans]
    order = sorted(range(len(plans)), key=lambda i: -bounds[i])
    done: list[tuple[float, float, int, StepResult]] = []  # (-tokens/s, memory, index, step), kept sorted
    for i in order:
        if len(done) >= top and bounds[i] < -done[top - 1][0]:
            break
        step = steps.step(plans[i].layout)
        done.append((-step.tokens_per_sec_per_gpu, plans[i].memory.total, i, step))
        done.sort(key=lambda d: d[:3])
    return Ranked([(simulated_plan(plans[i], step), step) for _, _, i, step in done[:top]], len(done))

"""The step simulator behind `llamatron plan` (docs/simulator.md): one optimizer step laid out as
a timeline of compute, tensor/context/expert-parallel and pipeline transfers and data-parallel collectives,
from the hardware profiles (hardware.yaml) and the measured efficiencies (calibration.yaml)."""

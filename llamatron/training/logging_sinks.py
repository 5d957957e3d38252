"""TensorBoard and Weights & Biases sinks, fed the same metric records as the JSON-lines file.

A record becomes scalars named `train/<key>` (step records) or `valid/<key>` (evaluation records,
`"split": "valid"`), at the record's `step`. Non-numeric and null values (e.g. MFU on CPU) are left out.
Both packages are optional: they are imported only when asked for, and a missing one is a ConfigError
naming the package to install, raised by `check_sink_dependencies` before any memory is allocated.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from ..config.output_paths import check_output_directory, check_output_file
from ..errors import ConfigError

# (config field, flag, module to import, pip package)
_OPTIONAL = (
    ("tensorboard_dir", "--tensorboard-dir", "torch.utils.tensorboard", "tensorboard"),
    ("wandb_project", "--wandb-project", "wandb", "wandb"),
)


def _import(module: str, flag: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{flag} needs the '{package}' package, which is not installed ({e}); "
            f"install it with `pip install {package}`"
        ) from None


def check_sink_dependencies(tensorboard_dir: str | None, wandb_project: str | None) -> None:
    """The packages of the sinks asked for are installed."""
    for value, (_, flag, module, package) in zip((tensorboard_dir, wandb_project), _OPTIONAL):
        if value:
            _import(module, flag, package)


def check_output_paths(metrics_file: str | None, tensorboard_dir: str | None) -> None:
    """--metrics-file can be opened for appending and --tensorboard-dir made a directory (both are created with
    their missing parents): checked by training/validate.py, so that a directory given as the file, a file given as
    the directory or an unwritable place is refused before the model is built."""
    if metrics_file:
        check_output_file(metrics_file, "--metrics-file")
    if tensorboard_dir:
        check_output_directory(tensorboard_dir, "--tensorboard-dir", "the TensorBoard event files")


def scalars(record: dict[str, Any]) -> tuple[str, int, dict[str, float]]:
    """(prefix, step, {key: value}) of the numeric fields of a metric record."""
    prefix = record.get("split") or "train"
    values = {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "split") and isinstance(v, (int, float)) and v is not None
    }
    return prefix, int(record["step"]), values


class TensorBoardSink:
    def __init__(self, log_dir: str):
        module = _import("torch.utils.tensorboard", "--tensorboard-dir", "tensorboard")
        self.writer = module.SummaryWriter(log_dir=log_dir)

    def __call__(self, record: dict[str, Any]) -> None:
        prefix, step, values = scalars(record)
        for key, value in values.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    """One W&B run; `mode` offline writes it under ./wandb (or $WANDB_DIR) with no network (`wandb sync` uploads)."""

    def __init__(self, project: str, mode: str | None, name: str | None, config: dict[str, Any]):
        self.wandb = _import("wandb", "--wandb-project", "wandb")
        try:  # mode None: W&B's own setting ($WANDB_MODE, else online)
            self.run = self.wandb.init(project=project, mode=mode, name=name, config=config)
        except Exception as e:  # no API key, no network, a bad project name: before any training is done
            raise ConfigError(
                f"--wandb-project {project}: W&B could not start a run ({type(e).__name__}: {e}); "
                "log in with `wandb login` (or set WANDB_API_KEY), or use --wandb-mode offline"
            ) from None

    def __call__(self, record: dict[str, Any]) -> None:
        prefix, step, values = scalars(record)
        # Step records and the evaluation at the same step share W&B's step; W&B keeps steps non-decreasing.
        self.run.log({f"{prefix}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as e:  # noqa: BLE001 -- never fail a finished training run over a logging service
            warnings.warn(f"W&B: finishing the run failed: {e}", stacklevel=2)


def build_metric_sinks(cfg) -> list:
    """The sinks the config asks for (called on the logging rank only)."""
    t = cfg.train
    sinks: list = []
    if t.tensorboard_dir:
        sinks.append(TensorBoardSink(t.tensorboard_dir))
    if t.wandb_project:
        sinks.append(WandbSink(t.wandb_project, t.wandb_mode, t.wandb_name, cfg.to_dict()))
    return sinks

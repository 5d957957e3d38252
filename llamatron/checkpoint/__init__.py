"""Checkpoints that do not depend on the layout, and the Hugging Face / Meta weight formats.

The API a training run uses (save, publish, load, inspect) is here; `reader.py` describes the format,
`writer.py` how ranks write it, `run_state.py` what a run's state is made of, `hf*.py` the conversions.
"""

from .reader import (
    META_FILE,
    MODEL_FILE,
    CheckpointReader,
    load_full_tensors,
    open_weights,
    read_meta,
    resolve_checkpoint,
    step_dirs,
    step_number,
)
from .run_state import (
    Checkpointing,
    begin_save,
    check_checkpoint_fits,
    finish_pending_save,
    load_checkpoint,
    load_model_weights,
    meta_to_inherit,
    read_model_config,
    save_checkpoint,
)

__all__ = [
    "META_FILE",
    "MODEL_FILE",
    "CheckpointReader",
    "Checkpointing",
    "begin_save",
    "check_checkpoint_fits",
    "finish_pending_save",
    "load_checkpoint",
    "load_full_tensors",
    "load_model_weights",
    "meta_to_inherit",
    "open_weights",
    "read_meta",
    "read_model_config",
    "resolve_checkpoint",
    "save_checkpoint",
    "step_dirs",
    "step_number",
]

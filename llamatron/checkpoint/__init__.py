"""Checkpoints that do not depend on the layout: llamatron's own format.

`reader.py` describes the format, `writer.py` how ranks write it, `loading.py` reads a model's config and
weights from it. What a training run saves and how it resumes is training/checkpointing.py's; other projects'
formats (Hugging Face, Meta, Megatron-LM) are converted to and from this one by interop/.
"""

from .loading import check_checkpoint_fits, load_model_weights, read_model_config
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

__all__ = [
    "META_FILE",
    "MODEL_FILE",
    "CheckpointReader",
    "check_checkpoint_fits",
    "load_full_tensors",
    "load_model_weights",
    "open_weights",
    "read_meta",
    "read_model_config",
    "resolve_checkpoint",
    "step_dirs",
    "step_number",
]

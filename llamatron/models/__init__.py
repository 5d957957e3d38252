from .config import ModelConfig, RopeScaling
from .families import PRESET_NAMES, config_from_dict, get_preset
from .init import materialize
from .kernels import KernelChoices, apply_kernels
from .transformer import IGNORE_INDEX, Transformer, build_model

__all__ = [
    "IGNORE_INDEX",
    "KernelChoices",
    "ModelConfig",
    "PRESET_NAMES",
    "RopeScaling",
    "Transformer",
    "apply_kernels",
    "build_model",
    "config_from_dict",
    "get_preset",
    "materialize",
]

from .config import ModelConfig, RopeScaling
from .init import materialize
from .presets import PRESET_NAMES, get_preset
from .transformer import IGNORE_INDEX, Transformer, build_model

__all__ = ["IGNORE_INDEX", "ModelConfig", "PRESET_NAMES", "RopeScaling", "Transformer", "build_model",
           "get_preset", "materialize"]

"""The small files of a Hugging Face (or Meta) directory, checked before anything is converted or written.

A truncated download otherwise fails midway (a JSONDecodeError after the weights were converted) or is copied
into the checkpoint unnoticed (a corrupt tokenizer.json). `read_hf_json` is the one reader of those JSON files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data.tokenizer import load_tokenizer
from ..errors import DataError, HFConversionError
from ..models.families import model_problems
from .hf import config_from_hf
from .meta_consolidated import is_meta_checkpoint

# The JSON files import-hf and verify read from a Hugging Face (or Meta) directory.
_JSON_FILES = (
    "config.json",
    "params.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def read_hf_json(path: Path) -> Any:
    """The JSON value of `path`, or an HFConversionError naming the file and the fix."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # also invalid UTF-8
        raise HFConversionError(
            f"{path} is not valid JSON ({e}); re-download it (a truncated file reads like this)"
        ) from None
    except OSError as e:
        raise HFConversionError(f"{path} cannot be read ({e.strerror})") from None


def check_hf_files(hf_dir: str | Path, tokenizer: bool) -> None:
    """Each JSON file of `hf_dir` parses to an object, config.json describes a model llamatron can build, and
    (`tokenizer`) its tokenizer loads."""
    d = Path(hf_dir)
    for path in (d / name for name in _JSON_FILES + (_TOKENIZER_JSON_FILES if tokenizer else ())):
        if not path.is_file():
            continue
        value = read_hf_json(path)
        if not isinstance(value, dict):
            raise HFConversionError(f"{path} must hold a JSON object, not {type(value).__name__}; re-download it")
        if path.name == "config.json" and not is_meta_checkpoint(d):
            _check_hf_config(path, value)
    if tokenizer and d.is_dir() and any((d / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        try:
            load_tokenizer(str(d))
        except DataError as e:
            raise HFConversionError(f"the tokenizer files of {d} cannot be loaded: {e}") from None
        except ImportError:  # a tokenizer.model without sentencepiece installed: copied unchecked
            pass


def _check_hf_config(path: Path, hf: dict) -> None:
    """config.json describes a model llamatron can build: its keys are there and of the right types."""
    try:
        cfg = config_from_hf(hf)
    except HFConversionError:  # a model llamatron does not convert: its own message
        raise
    except KeyError as e:
        raise HFConversionError(f"{path} has no {e.args[0]!r}, which the conversion needs; re-download it") from None
    except (TypeError, ValueError) as e:  # e.g. a string where a number belongs, met by the conversion's arithmetic
        raise HFConversionError(f"{path} holds a value of the wrong type ({e}); re-download it") from None
    problems = model_problems(cfg)
    if problems:
        raise HFConversionError(f"{path} describes a model llamatron cannot build: {'; '.join(problems)}")

"""Tokenizers: load Hugging Face / SentencePiece ones, train a small byte-level BPE.

``load_tokenizer`` returns a ``Tokenizer`` with one small interface whatever the
file format underneath. It never adds special tokens on its own: callers that
want BOS or EOD tokens add them explicitly, so the token stream written to
disk is exactly what the code asked for.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import tokenizers

from llamatron.errors import DataError

EOD_TOKEN = "<|endoftext|>"
# Tried in order when no tokenizer_config.json names the EOS token.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    """A loaded tokenizer: ``encode``, ``decode``, ``vocab_size``, ``eod_id``, ``bos_id``, ``save``."""

    def __init__(self, backend: Any, kind: str, source: str, config: dict | None) -> None:
        self._backend = backend
        self.kind = kind  # "huggingface" or "sentencepiece"
        self.source = source
        self._config = config
        self.eod_id: int | None = self._find_eod_id()
        self.bos_id: int | None = self._find_bos_id()

    @property
    def vocab_size(self) -> int:
        if self.kind == "sentencepiece":
            return self._backend.get_piece_size()
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod_token(self) -> str | None:
        if self.eod_id is None:
            return None
        if self.kind == "sentencepiece":
            return self._backend.id_to_piece(self.eod_id)
        return self._backend.id_to_token(self.eod_id)

    def encode(self, text: str) -> list[int]:
        if self.kind == "sentencepiece":
            return self._backend.encode(text, out_type=int)
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text; one call into the backend, which saves Python overhead."""
        if self.kind == "sentencepiece":
            return self._backend.encode(list(texts), out_type=int)
        # encode_batch_fast skips computing character offsets (tokenizers >= 0.20).
        batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [encoding.ids for encoding in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)

    def save(self, directory: str) -> None:
        """Write the tokenizer as a directory that ``load_tokenizer`` and transformers read."""
        os.makedirs(directory, exist_ok=True)
        if self.kind == "sentencepiece":
            with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
                f.write(self._backend.serialized_model_proto())
        else:
            self._backend.save(os.path.join(directory, "tokenizer.json"))
        config = self._config
        if config is None:
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
            if self.eod_token is not None:
                config["eos_token"] = self.eod_token
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    def _find_eod_id(self) -> int | None:
        if self.kind == "sentencepiece":
            eos = self._backend.eos_id()
            return eos if eos >= 0 else None
        named = _token_content((self._config or {}).get("eos_token"))
        candidates = ([named] if named else []) + list(KNOWN_EOS_TOKENS)
        for token in candidates:
            token_id = self._backend.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def _find_bos_id(self) -> int | None:
        """Only a BOS token the tokenizer names: unlike EOS there is no convention to guess one from."""
        if self.kind == "sentencepiece":
            bos = self._backend.bos_id()
            return bos if bos >= 0 else None
        named = _token_content((self._config or {}).get("bos_token"))
        return self._backend.token_to_id(named) if named else None

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.source!r}, kind={self.kind}, vocab_size={self.vocab_size}, eod_id={self.eod_id}, "
            f"bos_id={self.bos_id})"
        )


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as err:  # also invalid UTF-8
        raise DataError(f"{path}: not valid JSON ({err}); re-download the tokenizer files or remove this one") from err


def _read_config(directory: str) -> dict | None:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    config = _read_json(path)
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object of tokenizer settings; re-download it or remove it")
    # Older exports keep the BOS/EOS tokens only in special_tokens_map.json.
    special_map = os.path.join(directory, "special_tokens_map.json")
    if ("eos_token" not in config or "bos_token" not in config) and os.path.isfile(special_map):
        special = _read_json(special_map)
        special = special if isinstance(special, dict) else {}
        for key in ("eos_token", "bos_token"):
            if key not in config and special.get(key) is not None:
                config[key] = special[key]
    return config


def _load_json_tokenizer(json_file: str, source: str, config: dict | None) -> Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(json_file)
    except Exception as err:  # tokenizers raises a bare Exception ("expected value at line 1 column 1")
        raise DataError(
            f"{json_file}: not a valid Hugging Face tokenizer.json ({err}); re-download or re-save the "
            "tokenizer (a truncated or hand-edited file reads like this)"
        ) from err
    return Tokenizer(backend, "huggingface", source, config)


def _load_sentencepiece(model_file: str, config: dict | None) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError as err:
        raise ImportError(
            f"{model_file} is a SentencePiece model; reading it needs the sentencepiece package: "
            "pip install sentencepiece"
        ) from err
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    except Exception as err:  # sentencepiece raises RuntimeError or OSError for a corrupt model
        raise DataError(f"{model_file}: not a valid SentencePiece model ({err}); re-download the tokenizer") from err
    return Tokenizer(processor, "sentencepiece", model_file, config)


def load_tokenizer(path: str) -> Tokenizer:
    """Load a Hugging Face directory, a ``tokenizer.json`` or a SentencePiece ``.model``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        json_file = os.path.join(path, "tokenizer.json")
        model_file = os.path.join(path, "tokenizer.model")
        config = _read_config(path)
        if os.path.isfile(json_file):  # preferred: fast, and needs no extra package
            return _load_json_tokenizer(json_file, path, config)
        if os.path.isfile(model_file):
            return _load_sentencepiece(model_file, config)
        raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model in this directory")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: tokenizer not found (expected a directory, tokenizer.json or .model file)")
    config = _read_config(os.path.dirname(path) or ".")
    if path.endswith(".json"):
        return _load_json_tokenizer(path, path, config)
    if path.endswith(".model"):
        return _load_sentencepiece(path, config)
    raise DataError(f"{path}: unknown tokenizer format (expected a directory, a .json or a .model file)")


def _read_text_file(path: str) -> Iterator[str]:
    """Texts of a training file: one per line of a .jsonl(.gz) ("text" key), else the whole file."""
    if path.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def _names_a_file(item: str | os.PathLike) -> bool:
    if isinstance(item, os.PathLike):
        return True
    return len(item) < 4096 and "\n" not in item and os.path.isfile(item)


def _training_texts(files_or_texts: Iterable[str | os.PathLike]) -> Iterator[str]:
    for item in files_or_texts:
        if _names_a_file(item):
            yield from _read_text_file(os.fspath(item))
        else:
            yield str(item)


def train_bpe_tokenizer(
    files_or_texts: Iterable[str | os.PathLike] | str | os.PathLike,
    vocab_size: int,
    out_dir: str,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) and save it as ``out_dir/tokenizer.json``.

    Items that are ``Path`` objects or names of existing files are read as
    files (``.jsonl``/``.jsonl.gz``: the "text" of each line; otherwise the
    whole file); other strings are training texts. ``<|endoftext|>`` is the
    only special token and serves as EOS/EOD.
    """
    if isinstance(files_or_texts, (str, os.PathLike)):
        files_or_texts = [files_or_texts]
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small for byte-level BPE (need > {len(alphabet)})")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text exactly.
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(_training_texts(files_or_texts), trainer=trainer)
    tokenizer = Tokenizer(backend, "huggingface", out_dir, config=None)
    tokenizer.save(out_dir)
    return load_tokenizer(out_dir)

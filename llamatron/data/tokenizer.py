"""Tokenizers: load Hugging Face / SentencePiece / Llama 3 tiktoken ones, train a small byte-level BPE.

``load_tokenizer`` returns a ``Tokenizer`` with one small interface whatever the
file format underneath. It never adds special tokens on its own: callers that
want BOS or EOD tokens add them explicitly, so the token stream written to
disk is exactly what the code asked for.

A ``tokenizer.model`` is one of two formats, told apart by its content: a
SentencePiece model (a protobuf: Llama 1/2, Mistral) or tiktoken BPE ranks
(lines of ``base64(token bytes) rank``: Meta's Llama 3, 3.1, 3.2 and 3.3), which
``TiktokenTokenizer`` loads with Llama 3's special tokens and pre-tokenizer.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import tokenizers

from llamatron.errors import DataError, MissingPackageError

EOD_TOKEN = "<|endoftext|>"
# Tried in order when no tokenizer_config.json names the EOS token.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
CONFIG_FILE = "tokenizer_config.json"

# Llama 3's tokenizer, as Meta's llama-models defines it: this pre-tokenizer split, and 256 special tokens
# numbered after the BPE ranks (128000..128255 for the 128000 ranks of its tokenizer.model): these named ones
# first, then <|reserved_special_token_2|> onwards for the rest.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
LLAMA3_SPECIAL_TOKEN_COUNT = 256
# tiktoken's regex runs out of backtracking stack on a whitespace run of about a million characters: longer
# texts are encoded in pieces of at most this many, cut before a space that follows a non-space (where the
# split above cuts anyway), as Meta's own tokenizer also cuts long texts.
TIKTOKEN_MAX_PIECE_CHARS = 400_000
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+\r?\n?")


class Tokenizer:
    """A loaded tokenizer: ``encode``, ``decode``, ``vocab_size``, ``eod_id``, ``bos_id``, ``save``."""

    def __init__(self, backend: Any, kind: str, source: str, config: dict | None) -> None:
        self._backend = backend
        self.kind = kind  # "huggingface", "sentencepiece" or "tiktoken"
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

    @property
    def adds_bos(self) -> bool:
        """Whether this tokenizer's own default (transformers' add_special_tokens=True) puts a BOS token first:
        tokenizer_config.json's add_bos_token where it says, else what a tokenizer.json's post-processor does to an
        empty text (Llama 3's adds BOS, Qwen's nothing); SentencePiece and tiktoken ones (Llama 1/2, Mistral,
        Llama 3) add it. ``encode`` itself never adds it."""
        if self.bos_id is None:
            return False
        configured = (self._config or {}).get("add_bos_token")
        if isinstance(configured, bool):
            return configured
        if self.kind == "huggingface":
            return self._backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
        return True

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


class TiktokenTokenizer(Tokenizer):
    """Meta's Llama 3 ``tokenizer.model``: tiktoken BPE ranks, with Llama 3's special tokens and split.

    ``ranks`` (token bytes -> id), ``special_tokens`` (text -> id) and ``pattern`` are what it is made of;
    export-hf builds the equivalent Hugging Face tokenizer.json from them. Special-token text in the input is
    encoded as the special token, as Hugging Face tokenizers do.
    """

    def __init__(self, ranks: dict[bytes, int], source: str, config: dict | None) -> None:
        try:
            import tiktoken
        except ImportError as err:
            raise MissingPackageError(
                f"{source} is a Llama 3 (tiktoken) tokenizer.model; reading it needs the tiktoken package: "
                "pip install tiktoken"
            ) from err
        self.ranks = ranks
        self.pattern = LLAMA3_PATTERN
        self.special_tokens = llama3_special_tokens(len(ranks))
        name = os.path.basename(source)
        specials = self.special_tokens
        backend = tiktoken.Encoding(name, pat_str=self.pattern, mergeable_ranks=ranks, special_tokens=specials)
        super().__init__(backend, "tiktoken", source, config)

    @property
    def vocab_size(self) -> int:
        return self._backend.n_vocab

    @property
    def eod_token(self) -> str | None:
        return None if self.eod_id is None else self._token_text(self.eod_id)

    def encode(self, text: str) -> list[int]:
        return [i for piece in _tiktoken_pieces(text) for i in self._backend.encode(piece, allowed_special="all")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One text at a time: preprocess's --workers parallelise, tiktoken's thread pool would oversubscribe them.
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # Ids past the vocabulary (a model's padded rows) are dropped, as Hugging Face tokenizers do.
        return self._backend.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def save(self, directory: str) -> None:
        """Write ``tokenizer.model`` (the ranks, as Meta ships them); export-hf writes the transformers files."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
            for token, rank in sorted(self.ranks.items(), key=lambda item: item[1]):
                f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        if self._config is not None:
            with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
                json.dump(self._config, f, indent=2, ensure_ascii=False)

    def _token_text(self, token_id: int) -> str:
        return self._backend.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def _special_id(self, token: str | None) -> int | None:
        return self.special_tokens.get(token) if token else None

    def _find_eod_id(self) -> int | None:
        named = _token_content((self._config or {}).get("eos_token"))
        for token in ([named] if named else []) + list(KNOWN_EOS_TOKENS):
            if self._special_id(token) is not None:
                return self._special_id(token)
        return None

    def _find_bos_id(self) -> int | None:
        named = _token_content((self._config or {}).get("bos_token"))
        return self._special_id(named or "<|begin_of_text|>")


def llama3_special_tokens(num_ranks: int) -> dict[str, int]:
    """Llama 3's special tokens and their ids, after ``num_ranks`` BPE ranks."""
    reserved = LLAMA3_SPECIAL_TOKEN_COUNT - len(LLAMA3_NAMED_SPECIAL_TOKENS)
    names = list(LLAMA3_NAMED_SPECIAL_TOKENS) + [f"<|reserved_special_token_{2 + i}|>" for i in range(reserved)]
    return {name: num_ranks + i for i, name in enumerate(names)}


def _tiktoken_pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of at most TIKTOKEN_MAX_PIECE_CHARS characters (almost every text is one piece)."""
    start = 0
    while len(text) - start > TIKTOKEN_MAX_PIECE_CHARS:
        end = start + TIKTOKEN_MAX_PIECE_CHARS
        cut = text.rfind(" ", start + 1, end)
        while cut > start and text[cut - 1].isspace():
            cut = text.rfind(" ", start + 1, cut)
        cut = cut if cut > start else end  # no such space: a hard cut
        yield text[start:cut]
        start = cut
    yield text[start:]


def is_tiktoken_file(path: str) -> bool:
    """Whether ``path`` holds tiktoken BPE ranks (text lines of ``base64 rank``) rather than a SentencePiece
    protobuf, whose first byte (field 1's tag, 0x0a) already ends a first line this cannot match."""
    with open(path, "rb") as f:
        first = f.readline(4096)
    return _TIKTOKEN_LINE.fullmatch(first) is not None


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file, checked: ids 0..n-1 once each, and every single byte among them.

    Read here rather than by tiktoken's load_tiktoken_bpe, which caches a local file under its path in a
    temporary directory and would keep serving the old ranks after the file is replaced.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as err:  # also binascii.Error
                raise DataError(
                    f"{path}:{number}: not a 'base64-token rank' line of a tiktoken BPE file ({line[:60]!r}); "
                    "re-download the tokenizer (a truncated or corrupted file reads like this)"
                ) from err
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(
            f"{path}: the ranks of this tiktoken BPE file are not 0..{len(ranks) - 1} once each (repeated tokens or "
            "ids); re-download the tokenizer"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(
            f"{path}: this tiktoken BPE file lacks {len(missing)} of the 256 single-byte tokens (first: byte "
            f"{missing[0]}), so it cannot encode every text; re-download the tokenizer"
        )
    return ranks


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
        raise MissingPackageError(
            f"{model_file} is a SentencePiece model; reading it needs the sentencepiece package: "
            "pip install sentencepiece"
        ) from err
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    except Exception as err:  # sentencepiece raises RuntimeError or OSError for a corrupt model
        raise DataError(f"{model_file}: not a valid SentencePiece model ({err}); re-download the tokenizer") from err
    return Tokenizer(processor, "sentencepiece", model_file, config)


def _load_model_file(model_file: str, config: dict | None) -> Tokenizer:
    """A ``.model`` file: Llama 3's tiktoken ranks or a SentencePiece model, told apart by the content."""
    if is_tiktoken_file(model_file):
        return TiktokenTokenizer(read_tiktoken_ranks(model_file), model_file, config)
    with open(model_file, "rb") as f:
        first = f.read(1)
    if first != b"\x0a":  # a SentencePiece ModelProto starts with its pieces (field 1, length-delimited)
        raise DataError(
            f"{model_file}: neither a SentencePiece model nor tiktoken BPE ranks"
            f"{' (the file is empty)' if not first else ''}; re-download the tokenizer"
        )
    return _load_sentencepiece(model_file, config)


def load_tokenizer(path: str) -> Tokenizer:
    """Load a Hugging Face directory, a ``tokenizer.json``, or a ``.model`` (SentencePiece or Llama 3 tiktoken)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        json_file = os.path.join(path, "tokenizer.json")
        model_file = os.path.join(path, "tokenizer.model")
        config = _read_config(path)
        if os.path.isfile(json_file):  # preferred: fast, and needs no extra package
            return _load_json_tokenizer(json_file, path, config)
        if os.path.isfile(model_file):
            return _load_model_file(model_file, config)
        raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model in this directory")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: tokenizer not found (expected a directory, tokenizer.json or .model file)")
    config = _read_config(os.path.dirname(path) or ".")
    if path.endswith(".json"):
        return _load_json_tokenizer(path, path, config)
    if path.endswith(".model"):
        return _load_model_file(path, config)
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

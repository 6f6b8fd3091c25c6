"""Tokenizers: the byte-level default and Hugging Face ``tokenizer.json`` files (the ``tokenizers`` package).

``data.tokenizer = "bytes"`` (default): every byte is a token, vocabulary 256. A path to a
``tokenizer.json`` (e.g. one trained offline by ``hpctrain data train-tokenizer``, or shipped with a
Hugging Face model) tokenizes with it; nothing is ever downloaded. A tokenizer's identity is the
SHA-256 of its file: a prepared corpus records it, and training refuses a corpus made by another.

``eos_id``: the end-of-sequence token (None for ``bytes``): the ``eos_token`` of a ``tokenizer_config.json``
beside the tokenizer.json (as Hugging Face models ship it), else the first special token named like one
of ``EOS_NAMES``. ``encode_segment`` tokenizes a piece of text without the post-processor's special tokens
(a BOS a Llama tokenizer adds), for templates built piece by piece (hpctrain/data/sft.py).
"""
from __future__ import annotations

import hashlib
import json
import os

from hpctrain.errors import HpcTrainError

BYTES = "bytes"
EOS_NAMES = ("<|endoftext|>", "</s>", "<|eot_id|>", "<|im_end|>", "<eos>", "<|end_of_text|>")


class TokenizerError(HpcTrainError, ValueError):
    """A tokenizer cannot be loaded, trained or does not match (a user error)."""

    everywhere = True


class ByteTokenizer:
    """Bytes are tokens (0..255); decoding replaces invalid UTF-8."""

    name, identity, vocab_size, eos_id = BYTES, BYTES, 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_segment = encode

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a tokenizer.json file."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerError(f"data.tokenizer={path!r} needs the `tokenizers` package "
                                 f"(pip install tokenizers, or the hpctrain[data] extra)") from exc
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer file {path!r} does not exist (data.tokenizer takes 'bytes' or the "
                                 f"path of a tokenizer.json; make one with `hpctrain data train-tokenizer`)")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions
            raise TokenizerError(f"{path!r} is not a Hugging Face tokenizer.json: {exc}") from exc
        self.name, self.path = os.path.basename(path), os.path.abspath(path)
        self.identity = file_sha256(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(path)

    def _find_eos(self, path: str) -> int | None:
        config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        try:
            with open(config) as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and self.tok.token_to_id(eos) is not None:
            return self.tok.token_to_id(eos)
        special = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        return next((special[name] for name in EOS_NAMES if name in special), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_segment(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(spec: str):
    """``bytes`` or a tokenizer.json path -> a tokenizer with encode/decode/vocab_size/identity."""
    return ByteTokenizer() if spec in ("", BYTES) else HFTokenizer(spec)


def train_bpe(texts, vocab_size: int, out: str) -> str:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization, so any text round-trips) on the
    iterable of strings ``texts`` and write it to ``out`` atomically. Returns ``out``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise TokenizerError("train-tokenizer needs the `tokenizers` package (pip install tokenizers)") from exc
    if vocab_size < 257:
        raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = f"{out}.tmp.{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, out)
    return out

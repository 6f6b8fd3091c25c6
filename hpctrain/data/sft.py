"""Supervised fine-tuning data: JSONL examples -> token ids with a loss mask, in one HDF5 file.

Input, one JSON object a line (blank lines are skipped)::

    {"prompt": "...", "response": "..."}                     (optional "system": "...")
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

A prompt/response line is the conversation [system?, user: prompt, assistant: response]. Other keys
of a line ("id", "source", ...) and of a message ("name", ...) are ignored; a line with both "prompt"
and "messages", a missing or empty response, a messages list without an assistant turn, a role outside
system/user/assistant or a non-string content is refused.

Template ``hpctrain-chat-v1`` (plain text with role headers; NOT the tokenizer's chat template), every
turn::

    <|{role}|>\\n{content}<|end|>\\n

and, when the tokenizer has an end-of-sequence token (``eos_id``), that token after the last turn. Each
piece (header, content, ``<|end|>\\n``, eos) is tokenized on its own (``encode_segment``: no BOS or
other post-processor tokens), so a token belongs to exactly one piece. The loss counts (mask 1) the
content and ``<|end|>\\n`` of every assistant turn, and the eos when the last turn is the assistant's;
nothing else (headers, system and user turns). The mask of a token says whether it is counted as a
TARGET (predicted from the token before it); a document's first token is never one.

File layout (``format = "hpctrain-sft-v1"``; read by ``hpctrain.data.packing.SFTCorpus``)::

    /tokens        1-D uint16 (uint32 above 65536 ids): every example's ids, in input order
    /loss_mask     1-D uint8 like tokens: 1 = counted in the loss as a target
    /doc_offsets   1-D int64, n + 1: example d is tokens[doc_offsets[d]:doc_offsets[d + 1]]
    /doc_counted   1-D int64, n: counted tokens of each example
    /doc_names     1-D strings: "FILE:LINE" of each example
    attrs: format, template, tokenizer, tokenizer_sha256, vocab_size, max_token, eos_id (-1: none),
           num_tokens, num_docs, counted_tokens
"""
from __future__ import annotations

import json
import os

import numpy as np

from hpctrain.data.documents import DataError
from hpctrain.errors import everywhere

FORMAT = "hpctrain-sft-v1"
TEMPLATE = "hpctrain-chat-v1"
ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>\n"


def turn_header(role: str) -> str:
    return f"<|{role}|>\n"


def example_messages(record, where: str) -> list[tuple[str, str]]:
    """One parsed JSONL line -> [(role, content), ...]; DataError naming ``where`` ("FILE:LINE") if invalid."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        if "prompt" in record or "response" in record:
            raise DataError(f"{where}: give either \"messages\" or \"prompt\"/\"response\", not both")
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        turns = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise DataError(f"{where}: message {i} needs a \"role\" of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise DataError(f"{where}: message {i} needs a string \"content\"")
            turns.append((message["role"], message["content"]))
    else:
        for key in ("prompt", "response"):
            if key not in record:
                raise DataError(f"{where}: no \"{key}\" (a line is {{\"prompt\": ..., \"response\": ...}} "
                                f"or {{\"messages\": [...]}})")
            if not isinstance(record[key], str):
                raise DataError(f"{where}: \"{key}\" must be a string")
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise DataError(f"{where}: \"system\" must be a string")
        turns = ([("system", system)] if system else []) + [("user", record["prompt"]),
                                                            ("assistant", record["response"])]
    answers = [content for role, content in turns if role == "assistant"]
    if not answers:
        raise DataError(f"{where}: no assistant turn (nothing for the loss to count)")
    if not all(content.strip() for content in answers):
        raise DataError(f"{where}: an empty response (assistant content)")
    return turns


def render(turns: list[tuple[str, str]], tokenizer) -> tuple[list[int], list[int]]:
    """The template applied to ``turns`` -> (token ids, loss mask), one entry per token (module docstring)."""
    ids, mask = [], []
    for role, content in turns:
        counted = int(role == "assistant")
        for text, flag in ((turn_header(role), 0), (content, counted), (END_OF_TURN, counted)):
            piece = tokenizer.encode_segment(text)
            ids += piece
            mask += [flag] * len(piece)
    if tokenizer.eos_id is not None:
        ids.append(int(tokenizer.eos_id))
        mask.append(int(turns[-1][0] == "assistant"))
    if mask:
        mask[0] = 0  # a document's first token is never a target
    return ids, mask


def chat_prompt_ids(prompt: str, tokenizer, system: str = "") -> list[int]:
    """The ids a model fine-tuned on this template continues with its answer to ``prompt``: the system and
    user turns, then the assistant's header, each piece tokenized as ``render`` does (``hpctrain generate
    --chat``; the answer ends with ``END_OF_TURN``)."""
    turns = ([("system", system)] if system else []) + [("user", prompt)]
    pieces = [text for role, content in turns for text in (turn_header(role), content, END_OF_TURN)]
    return [i for text in pieces + [turn_header("assistant")] for i in tokenizer.encode_segment(text)]


def read_examples(path: str, tokenizer) -> list[tuple[str, list[int], list[int]]]:
    """Every example of one JSONL file -> [("FILE:LINE", ids, mask)]; DataError naming the line if bad."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    examples = []
    for number, raw in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
        ids, mask = render(example_messages(record, where), tokenizer)
        examples.append((where, ids, mask))
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    return examples


def prepare_sft(inputs: list[str], tokenizer, out: str, force: bool = False) -> dict:
    """Tokenize the JSONL files ``inputs`` into the SFT corpus ``out`` (temporary name, then renamed: an
    error leaves nothing). Returns the summary. One process."""
    if os.path.exists(out) and not force:
        raise DataError(f"{out} exists: choose another --out or pass --force to replace it")
    missing = [p for p in inputs if not os.path.isfile(p)]
    if missing:
        raise DataError(f"input {missing[0]!r} is not a file (--format sft-jsonl takes JSONL files)")
    examples = [example for path in inputs for example in read_examples(path, tokenizer)]
    lengths = np.array([len(ids) for _, ids, _ in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    tokens = np.fromiter((i for _, ids, _ in examples for i in ids), dtype=np.int64, count=int(offsets[-1]))
    mask = np.fromiter((m for _, _, mask in examples for m in mask), dtype=np.uint8, count=int(offsets[-1]))
    counted = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) if len(mask) else np.zeros(0, np.int64)
    summary = {"path": out, "documents": len(examples), "tokens": int(offsets[-1]), "counted": int(counted.sum()),
               "dtype": str(np.dtype(dtype)), "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name,
               "max_token": int(tokens.max()), "longest": int(lengths.max()), "eos_id": tokenizer.eos_id}
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        _write(tmp, tokens.astype(dtype), mask, offsets, counted, [w for w, _, _ in examples], tokenizer, summary)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return summary


def _write(tmp, tokens, mask, offsets, counted, names, tokenizer, summary) -> None:
    import h5py

    with h5py.File(tmp, "w") as f:
        f["tokens"], f["loss_mask"], f["doc_offsets"], f["doc_counted"] = tokens, mask, offsets, counted
        f["doc_names"] = np.array(names, dtype=object).astype(h5py.string_dtype())
        f.attrs.update({"format": FORMAT, "template": TEMPLATE, "tokenizer": tokenizer.name,
                        "tokenizer_sha256": tokenizer.identity, "vocab_size": tokenizer.vocab_size,
                        "max_token": summary["max_token"], "num_tokens": summary["tokens"],
                        "num_docs": summary["documents"], "counted_tokens": summary["counted"],
                        "eos_id": -1 if tokenizer.eos_id is None else int(tokenizer.eos_id)})


def prepare_sft_collective(comm, inputs: list[str], tokenizer, out: str, force: bool = False) -> dict:
    """Collective over ``comm`` (``rank``, ``broadcast_object``): rank 0 runs ``prepare_sft`` (SFT sets are
    small), the others wait; its summary or its error (raised on every rank) is the result."""
    result = None
    if comm.rank == 0:
        try:
            result = prepare_sft(inputs, tokenizer, out, force)
        except (DataError, OSError) as exc:
            result = {"error": str(exc)}
    result = comm.broadcast_object(result, root=0)
    if "error" in result:
        raise everywhere(DataError(result["error"]))
    return result

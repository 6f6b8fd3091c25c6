"""``hpctrain generate``: text from a checkpoint on one process, with temperature and top-k sampling from a
seeded generator, so a seed gives the same text every time; temperature 0 is greedy. Generation stops at
the tokenizer's end-of-sequence token, at any ``--stop`` text (cut off), or after ``--max-new-tokens``;
``--chat`` wraps the prompt in the fine-tuning template (``data/sft.py``) and stops at the turn's end. A tool
above the model, the checkpoint reader and the tokenizer it combines.

No KV cache: each new token runs the model over the last ``max_seq_len`` tokens (the models trained
here are small; a cache would be the next step for big ones).
"""
from __future__ import annotations

import torch

from hpctrain.config import resolve_model
from hpctrain.data.sft import END_OF_TURN, chat_prompt_ids
from hpctrain.data.tokenizer import load_tokenizer
from hpctrain.errors import HpcTrainError
from hpctrain.interop.sources import load_run_model


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, vocab_limit: int = 0, until=None) -> list[int]:
    """``prompt_ids`` followed by at most ``max_new_tokens`` sampled ids. ``model``: a whole GPTStage (ids [B, S]
    -> logits [S, B, V] over the true vocabulary: its padding rows never reach them). ``vocab_limit`` > 0:
    sample only ids below it (the tokenizer's; a model may have more ids than its tokenizer). ``until(new)``:
    True stops after the new ids ``new`` so far."""
    if not prompt_ids:
        raise HpcTrainError("the prompt is empty: give at least one character")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise HpcTrainError(f"--temperature ({temperature}), --top-k ({top_k}) and --max-new-tokens "
                            f"({max_new_tokens}) must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long)
        logits = model(context)[-1, 0].double()
        if vocab_limit:
            logits = logits[:vocab_limit]
        if temperature == 0:
            ids.append(int(logits.argmax()))
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            ids.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)))
        if until is not None and until(ids[len(prompt_ids):]):
            break
    return ids


def generate_text(path: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 40,
                  seed: int = 0, tokenizer: str = "", stop: tuple[str, ...] = (), chat: bool = False,
                  base: str = "") -> tuple[str, dict]:
    """(completion text, info) for ``prompt`` from the checkpoint at ``path`` (any layout; a LoRA run's: base +
    adapters, ``base`` where its referred base is now if it moved), with the run's tokenizer (``data.tokenizer``)
    unless ``tokenizer`` is given. The text ends before the end-of-sequence token or the first ``stop`` text
    (``chat``: the prompt as a user turn of the fine-tuning template, and ``<|end|>`` stops);
    ``info["stopped"]``: "eos", the stop text, or "max_new_tokens"."""
    torch.set_num_threads(1)
    cfg, model, attrs = load_run_model(path, base=base)
    tok = load_tokenizer(tokenizer or cfg.data.tokenizer)
    m = resolve_model(cfg.model)
    if tok.vocab_size > m.vocab_size:
        raise HpcTrainError(f"tokenizer {tok.name} has {tok.vocab_size} tokens, the model {m.vocab_size}: "
                            f"not the tokenizer this model was trained with")
    if any(not text for text in stop):
        raise HpcTrainError("--stop: an empty stop text")
    stops = tuple(stop) + ((END_OF_TURN.strip(),) if chat else ())
    prompt_ids = chat_prompt_ids(prompt, tok) if chat else tok.encode(prompt)

    def until(new: list[int]) -> bool:
        return (tok.eos_id is not None and new[-1] == tok.eos_id) or any(s in tok.decode(new) for s in stops)

    ids = generate_ids(model, prompt_ids, max_new_tokens, m.max_seq_len, temperature, top_k, seed, tok.vocab_size,
                       until=until if stops or tok.eos_id is not None else None)
    new = ids[len(prompt_ids):]
    stopped = "max_new_tokens"
    if new and tok.eos_id is not None and new[-1] == tok.eos_id:
        new, stopped = new[:-1], "eos"
    text = tok.decode(new)
    hits = [(text.index(s), s) for s in stops if s in text]
    if hits:
        cut, stopped = min(hits)
        text = text[:cut]
    info = {"checkpoint": attrs["path"], "step": attrs.get("step"), "tokenizer": tok.name,
            "prompt_tokens": len(prompt_ids), "new_tokens": len(ids) - len(prompt_ids), "stopped": stopped,
            "lora": f"LoRA r={cfg.lora.rank} on {','.join(cfg.lora.targets)}" if cfg.lora.rank else ""}
    return text, info

"""``hpctrain generate``: text from a checkpoint on one process, with temperature and top-k sampling from a
seeded generator, so a seed gives the same text every time; temperature 0 is greedy. A tool above the
model, the checkpoint reader and the tokenizer it combines.

No KV cache: each new token runs the model over the last ``max_seq_len`` tokens (the models trained
here are small; a cache would be the next step for big ones).
"""
from __future__ import annotations

import torch

from hpctrain.checkpoint.weights import load_model, open_checkpoint
from hpctrain.config import resolve_model
from hpctrain.data.tokenizer import load_tokenizer
from hpctrain.errors import HpcTrainError


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, vocab_limit: int = 0) -> list[int]:
    """``prompt_ids`` followed by ``max_new_tokens`` sampled ids. ``model``: a whole GPTStage (ids [B, S]
    -> logits [S, B, V] over the true vocabulary: its padding rows never reach them). ``vocab_limit`` > 0:
    sample only ids below it (the tokenizer's; a model may have more ids than its tokenizer)."""
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
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)))
    return ids


def generate_text(path: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 40,
                  seed: int = 0, tokenizer: str = "") -> tuple[str, dict]:
    """(completion text, info) for ``prompt`` from the checkpoint at ``path`` (any layout; a LoRA run's: base +
    adapters), with the run's tokenizer (``data.tokenizer``) unless ``tokenizer`` is given."""
    torch.set_num_threads(1)
    reader = open_checkpoint(path)
    try:
        cfg, model = load_model(reader)
    finally:
        reader.close()
    tok = load_tokenizer(tokenizer or cfg.data.tokenizer)
    m = resolve_model(cfg.model)
    if tok.vocab_size > m.vocab_size:
        raise HpcTrainError(f"tokenizer {tok.name} has {tok.vocab_size} tokens, the model {m.vocab_size}: "
                            f"not the tokenizer this model was trained with")
    prompt_ids = tok.encode(prompt)
    ids = generate_ids(model, prompt_ids, max_new_tokens, m.max_seq_len, temperature, top_k, seed, tok.vocab_size)
    info = {"checkpoint": reader.path, "step": reader.attrs.get("step"), "tokenizer": tok.name,
            "prompt_tokens": len(prompt_ids), "new_tokens": len(ids) - len(prompt_ids),
            "lora": f"LoRA r={cfg.lora.rank} on {','.join(cfg.lora.targets)}" if cfg.lora.rank else ""}
    return tok.decode(ids[len(prompt_ids):]), info

"""``hpctrain generate``: sample text from a checkpoint (any layout) on one process."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint or run directory (one process)")
    p.add_argument("checkpoint", help="a run directory, its checkpoints directory, or a step directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same text")
    p.add_argument("--tokenizer", default="", help="override the run's data.tokenizer (bytes or a tokenizer.json)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable); the tokenizer's end-of-sequence token always stops")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user turn of the fine-tuning template (hpctrain-chat-v1); prints the "
                        "answer alone, up to its <|end|>")
    p.add_argument("--base", default="", metavar="PATH",
                   help="where a LoRA run's base is now, if it moved from the path its checkpoints refer to")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import sys

    from hpctrain.tools.generate import generate_text

    text, info = generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                               args.seed, args.tokenizer, tuple(args.stop), args.chat, args.base)
    lora = f", {info['lora']}" if info.get("lora") else ""
    print(f"[{info['checkpoint']}, step {info['step']}, tokenizer {info['tokenizer']}, seed {args.seed}{lora}, "
          f"{info['new_tokens']} new tokens, stopped at {info['stopped']}]", file=sys.stderr)
    print(text if args.chat else args.prompt + text)
    return 0

"""Load an adapter exported by hpctrain with peft onto its base and answer a question greedily, as
``hpctrain generate --chat --temperature 0`` does; exits 1 if the two answers differ.

    python examples/sft/peft_generate.py work/base work/adapter work/run "What is 2 + 3?"
"""
import sys

import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from hpctrain.data.sft import END_OF_TURN, chat_prompt_ids
from hpctrain.data.tokenizer import load_tokenizer
from hpctrain.tools.generate import generate_text

base_dir, adapter_dir, run_dir, question = sys.argv[1:5]
tok = load_tokenizer("bytes")
model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
prompt = chat_prompt_ids(question, tok)
with torch.no_grad():
    ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
answer = tok.decode(ids[len(prompt):])
answer = answer[:answer.index(END_OF_TURN.strip())] if END_OF_TURN.strip() in answer else answer
ours, _ = generate_text(run_dir, question, max_new_tokens=24, temperature=0, chat=True)
print(f"peft + transformers: {answer!r}\nhpctrain generate:   {ours!r}")
sys.exit(0 if answer == ours else 1)

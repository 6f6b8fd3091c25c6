"""A small Llama made by transformers (random weights, byte vocabulary), saved as a Hugging Face directory:
the "pretrained model" of the fine-tuning example (examples/sft/finetune.sh).

    python examples/sft/make_base.py work/base
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
print(f"a {sum(p.numel() for p in LlamaForCausalLM(config).parameters()):,}-parameter Llama written to {sys.argv[1]}")

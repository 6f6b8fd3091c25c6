"""Interoperability with other model formats: Hugging Face Llama (``hf.py``: names, shapes, config;
``sources.py``: global weights from an HF directory or an hpctrain checkpoint, ``model.init_from``;
``cli.py``: ``hpctrain export --format hf`` and ``hpctrain import-hf``; ``staging.py``: what they write) and
Hugging Face PEFT LoRA adapters (``peft.py``: adapter_config.json + adapter_model.safetensors, merging;
``peft_cli.py``: ``export --format peft``, ``--merge-lora``, ``hpctrain import-peft``). See
docs/models-and-data.md."""

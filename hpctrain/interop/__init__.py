"""Interoperability with other model formats: Hugging Face Llama (``hf.py``: names, shapes, config;
``sources.py``: global weights from an HF directory or an hpctrain checkpoint, ``model.init_from``;
``staging.py``: what ``hpctrain export`` and ``import-hf`` write) and Hugging Face PEFT LoRA adapters
(``peft.py``: adapter_config.json + adapter_model.safetensors, merging). The commands (``export``,
``import-hf``, ``import-peft``) are ``hpctrain/commands/interop.py`` and ``peft.py``. See
docs/models-and-data.md."""

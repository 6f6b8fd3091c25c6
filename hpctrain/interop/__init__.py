"""Interoperability with other model formats: Hugging Face Llama (``hf.py``: names, shapes, config;
``sources.py``: global weights from an HF directory or an hpctrain checkpoint, ``model.init_from``;
``cli.py``: ``hpctrain export --format hf`` and ``hpctrain import-hf``). See docs/models-and-data.md."""

"""Command-line tools around training runs: ``python -m hpctrain.tools.loss_compare`` (two runs, one loss
curve, step by step), ``python -m hpctrain.tools.config_doc`` (the configuration reference tables),
``hpctrain info`` (``info.py``) and ``hpctrain generate`` (``generate.py``: text from a checkpoint; its
parser in ``hpctrain/commands/tools.py``)."""

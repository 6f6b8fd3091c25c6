"""Command-line tools around training runs: ``python -m hpctrain.tools.loss_compare`` (two runs, one loss
curve, step by step) and ``python -m hpctrain.tools.config_doc`` (the configuration reference tables)."""

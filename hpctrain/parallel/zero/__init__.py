"""Where a parameter's bytes live: the parameter engine (engine.py, ``build_param_engine``) over the trainable
groups (groups.py), ZeRO-3's frozen slices (frozen_slices.py) and ZeRO-3's gatherer of units (gather.py)."""

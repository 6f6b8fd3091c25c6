"""hpctrain: MPI-native training of large models on supercomputers.

Layers, bottom up: ``runtime``, ``data``, ``profiling``, ``config`` (configuration and layout rules),
``plan``, ``sweep``, ``monitor``, ``comm`` (backends, collectives, grid), ``compression``, ``parallel``,
``models``, ``optim``, ``checkpoint``, ``interop``, ``train``; ``bench``, ``tools`` and ``cli`` (the entry
point and ``commands``, one module per subcommand) on top.
Layers import only downward: the table is ``hpctrain/layers.py``, described in docs/architecture.md.
"""
__version__ = "0.1.0"

"""hpctrain: MPI-native training of large models on supercomputers.

Layers, bottom up: ``runtime``, ``profiling``, ``config`` (configuration and layout rules), ``comm``
(backends, collectives, grid), ``data``, ``compression``, ``parallel``, ``models``, ``optim``,
``checkpoint``, ``interop``, ``train``; ``plan``, ``sweep``, ``bench``, ``tools`` and ``cli`` on top.
Layers import only downward: the table is ``hpctrain/layers.py``, described in docs/architecture.md.
"""
__version__ = "0.1.0"

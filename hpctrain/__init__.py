"""hpctrain: MPI-native training of large models on supercomputers.

Layers, bottom up: ``runtime`` (who am I, which device), ``comm`` (process grid and collectives),
``parallel`` (the layout rules; tensor / pipeline / data parallelism), ``models``, ``optim``,
``train``, ``checkpoint``; ``tools``, ``bench`` and ``cli`` on top. Layers import only downward.
See docs/architecture.md.
"""
__version__ = "0.1.0"

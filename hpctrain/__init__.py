"""hpctrain: MPI-native training of large models on supercomputers.

Layers, bottom up: ``runtime`` (who am I), ``comm`` (process grid and collectives),
``parallel`` (tensor / pipeline / data parallelism), ``models``, ``train``, ``checkpoint``,
``scheduler``. See docs/architecture.md.
"""
__version__ = "0.1.0"

"""Gradient compression for the data-parallel reduction (docs/compression.md).

The split follows GRACE (Xu et al., 2021): a **compressor** turns a gradient chunk into a fixed-size
payload and back (one small module per method family: ``quantize.py``, ``sparse.py``, ``zfp.py``;
PowerSGD, which is not chunk-wise, is ``powersgd.py``), **error-feedback memory** keeps what
compression dropped and adds it to the next step (``memory.py``), and a **communication strategy**
builds a sum from pieces MPI can move but not add (``exchange.py``). ``reducer.py`` is the seam the
data-parallel engine calls (``GradReducer``: dense all-reduce / ZeRO-1 reduce-scatter is one
implementation, compressed reducers are others); ``methods.py`` names the methods (``COMPRESSORS``, an
explicit table) and ``build_reducer`` picks one from ``[compression]``.
"""
from hpctrain.compression.methods import COMPRESSORS, build_reducer  # noqa: F401
from hpctrain.compression.reducer import DenseReducer, GradReducer  # noqa: F401

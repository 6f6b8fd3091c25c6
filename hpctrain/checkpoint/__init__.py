"""HDF5 checkpoints: one global, layout-independent view of the training state (docs/checkpoint-format.md)."""

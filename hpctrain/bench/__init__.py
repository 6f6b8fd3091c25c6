"""Benchmarks run under MPI: ``hpctrain bench comm`` (collectives; see hpctrain.bench.comm)."""

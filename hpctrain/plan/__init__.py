"""Performance and memory model; `hpctrain plan`."""

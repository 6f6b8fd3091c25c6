"""Live monitoring of a training run (docs/monitoring.md): Prometheus metrics (served on rank 0 and/or a
node_exporter textfile), TensorBoard event files, and per-rank step times gathered every few steps to find
stragglers. ``hpctrain/config/metric_names.py`` names every metric; ``run_monitor.py`` is what the training
loop calls."""

"""Where the time goes: phase timers (always on, cheap), per-rank traces (``train.trace``), the report."""

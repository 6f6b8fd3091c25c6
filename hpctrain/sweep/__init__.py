"""Scaling studies: runs over rank counts and layouts, one CSV, plots (hpctrain sweep)."""

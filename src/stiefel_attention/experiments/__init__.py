"""Experiment families: one readable file each, with `run(config)` and the cells of each experiment."""

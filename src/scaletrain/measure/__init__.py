"""Figures about a job before or beside training it: the scaling table and its projection (bench.py), a learning
rate and the largest batch that fits (tune.py), what a training step holds per device (memory.py)."""

"""Driver side, after training: is pre-training learning anything? The baselines a held-out accuracy must beat
(baselines.py) and the learning curves drawn against them (curves.py)."""

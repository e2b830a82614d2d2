"""A pre-training worker's running numbers: the logging window's device-side sums (meter.py), the ETA's arithmetic
(eta.py), and the object that holds them all for the loop: what each step costs, the window, the curves, the
progress line (training_metrics.py)."""

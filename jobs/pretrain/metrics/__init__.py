"""A pre-training worker's running numbers: the logging window's device-side sums (meter.py), the ETA's arithmetic
(eta.py), and what each step costs and reports (step_clock.py)."""

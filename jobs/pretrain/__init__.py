"""Pre-training: Ray Train + DeepSpeed ZeRO, MLM + NSP (driver side in stage.py, worker side in loop.py)."""

"""The DeepSpeed engine a pre-training worker trains, and what it is made of: the model and the engine built apart
from the loop (build.py), the generated DeepSpeed JSON (deepspeed_config.py), the optimizers and the LR schedule
(optim.py), LAMB's per-parameter layouts over ZeRO's flat tensors (lamb_layout.py) and the ZeRO 1/2 fast paths
(zero_fast_paths.py)."""

"""Warm worker starts: a restarted or grown worker group's processes forked from one that has already imported
most of what a training worker imports (torch, dynamo, DeepSpeed, MLflow; not Ray Train or Ray Data: zygote.py says
why), instead of starting Python and importing them again on every restart: ~8 s of one core per worker
(benchmarks/README.md).

launcher.py is the workers' Python command (Ray's runtime env `py_executable`, set by runtime_env.py): it asks its
node's warm process (zygote.py) for a fork, starting that process on the node's first worker, and runs the worker
cold, exactly as Ray would, whenever a fork is not to be had.
"""

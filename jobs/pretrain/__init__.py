"""Pre-training: Ray Train + DeepSpeed ZeRO, MLM + NSP.

Driver side: stage.py (checks, the TorchTrainer, the manifest), runs.py (what names a run's folder), attempts.py
(restarts told), learning/ (baselines and curves after training). Worker side: loop.py (the training loop, as named
steps) over a worker.py Worker and its parts: engine/ (the DeepSpeed engine and what it is made of), data/ (streams,
masking, held-out rows), metrics/ (window, ETA, progress), checkpointing/ (save, load, resume, export);
evaluation.py (held-out accuracy). Between them, on the cluster: elastic.py, drain.py (Ray Train's scaling policy,
a drained node) and warm_start/ (workers forked from a warm process per node). config.py and worker_spec.py are
what both sides share.
"""

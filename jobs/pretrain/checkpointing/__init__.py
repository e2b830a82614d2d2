"""A pre-training run's checkpoints: their folders on storage (folders.py), where a resumed run goes on in the data
and in another layout (resume.py), the optimizer state re-partitioned for another worker count (repartition.py),
and the final Hugging Face export (export.py)."""

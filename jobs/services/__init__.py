"""What the training jobs share with the workflow, below both: MLflow (tracking, and the registered model's loader
pyfunc_model), config hashing and loading helpers (configtools), cluster capacity (capacity), signals
(interrupts), failure causes (causes). Imports the framework only (tests/test_layers.py)."""

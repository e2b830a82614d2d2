"""Data stages of the BERT pre-training pipeline (Ray Data): clean -> vocab -> pairs."""

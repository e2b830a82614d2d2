"""SQuAD v1.1 / v2.0 fine-tuning: reading, window features, n-best prediction, official metrics, trial, stage."""

"""GLUE fine-tuning: one trial per (task x learning rate x seed), fanned out as Ray tasks."""

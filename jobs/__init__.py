"""What runs on the cluster: the workflow of stages, pre-training, GLUE fine-tuning, tracking and the CLI."""

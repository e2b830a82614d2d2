"""GLUE on the fine-tuning engine (stage key `glue`): one trial per (task x learning rate x seed)."""

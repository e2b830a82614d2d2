"""GLUE on the fine-tuning engine (stage key `finetune`): one trial per (task x learning rate x seed)."""

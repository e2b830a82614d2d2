"""The fine-tuning engine GLUE, SQuAD and NER share: the recipe, the trial loop, the fan-out on Ray, what is
kept for a rerun, the inputs (the BERT folder, its tokenizer) and word-level rows for tagging."""

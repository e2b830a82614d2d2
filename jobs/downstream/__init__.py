"""What the SQuAD and NER jobs share: tokenizer, optimizer recipe, the learning-rate x seed fan-out."""

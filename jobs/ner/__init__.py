"""CoNLL-2003 NER fine-tuning: column reader, first-WordPiece labels, conlleval scoring, trial, stage."""

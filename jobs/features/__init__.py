"""Feature-based use of BERT: the frozen encoder's hidden states per word, extracted as a Ray Data job."""

"""The files the data stages hand to training, read without importing the stages that make them: the pairs stage's
shards, the vocabulary (vocab.txt) and the project's one tokenizer over it."""

"""The data side of the BERT pre-training pipeline, in three layers (README "House rules" draws them,
tests/test_layers.py checks them):

- `framework`: what every stage and job uses: the stage contract and manifests, storage, workdir paths, outputs and
  kept parts, input identity, the console and progress lines, redaction, the workdir lock, config field checks;
- `formats`: the files the data stages hand to training: shards, the vocabulary and the tokenizer over it;
- `stages`: the data stages themselves (Ray Data): clean -> vocab -> pairs.
"""

"""Typed config of the `features` stage (feature-based BERT: frozen hidden states per word, on Ray Data)."""
from __future__ import annotations

from dataclasses import dataclass

from bertpipe.pipeline.framework.config_fields import at_least, one_of, path_field, sequence_length

# How extract.py combines the hidden states (here, not there: loading a config must not import torch).
MODES = ("last_four_concat", "last", "sum_last_four")


@dataclass(frozen=True, kw_only=True)
class FeaturesConfig:
    # A CoNLL column file (token ... tag): the words are read from its first column, the tags are kept.
    input_file: str = path_field()
    # A Hugging Face-layout BERT folder. Empty: the pre-training export.
    init: str = path_field()
    # last_four_concat (the paper's best feature-based NER input), last, or sum_last_four.
    mode: str = "last_four_concat"
    entity_types: tuple[str, ...] = ("PER", "LOC", "ORG", "MISC")
    max_seq_length: int = 128
    batch_size: int = 32  # sentences per Ray Data batch (one forward pass)
    num_actors: int = 2  # actor pool size: each actor loads the model once
    cpus_per_actor: int = 1

    def __post_init__(self) -> None:
        one_of("features", self, "mode", MODES)
        at_least("features", self, 1, "batch_size", "num_actors", "cpus_per_actor")
        sequence_length("features", self)
        if not self.entity_types or any(not t or "-" in t for t in self.entity_types):
            raise ValueError(f"features.entity_types must be non-empty names without '-', got {self.entity_types}")

"""Typed config of the `features` stage (feature-based BERT: frozen hidden states per word, on Ray Data)."""
from __future__ import annotations

from dataclasses import dataclass

from bertpipe.pipeline.config import path_field


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
        from bertpipe.jobs.features.extract import MODES

        if self.mode not in MODES:
            raise ValueError(f"features.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("batch_size", "num_actors", "cpus_per_actor"):
            if getattr(self, name) < 1:
                raise ValueError(f"features.{name} must be >= 1, got {getattr(self, name)}")
        if not 16 <= self.max_seq_length <= 512:
            raise ValueError(f"features.max_seq_length must be in [16, 512], got {self.max_seq_length}")
        if not self.entity_types or any(not t or "-" in t for t in self.entity_types):
            raise ValueError(f"features.entity_types must be non-empty names without '-', got {self.entity_types}")

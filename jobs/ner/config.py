"""Typed config of the `ner` stage (CoNLL-2003). Defaults: the BERT paper's fine-tuning grid values (batch 32,
learning rate among 5e-5 / 3e-5, a few epochs), sequences of 128 WordPieces (a longer sentence is cut at word
boundaries into several rows)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bertpipe.jobs.tuning.recipe import Recipe
from bertpipe.pipeline.framework.config_fields import one_of, path_field


@dataclass(frozen=True, kw_only=True)
class NerConfig(Recipe):
    SECTION: ClassVar[str] = "ner"

    # CoNLL column files (token ... tag; blank line between sentences; -DOCSTART- lines between documents).
    train_file: str = path_field()
    eval_file: str = path_field()
    # auto: IOB1 when some entity starts with I-, else IOB2. Or iob1 / iob2.
    scheme: str = "auto"
    entity_types: tuple[str, ...] = ("PER", "LOC", "ORG", "MISC")
    num_epochs: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("ner", self, "scheme", ("auto", "iob1", "iob2"))
        if not self.entity_types or any(not t or "-" in t for t in self.entity_types):
            raise ValueError(f"ner.entity_types must be non-empty names without '-', got {self.entity_types}")

    @property
    def labels(self) -> tuple[str, ...]:
        """The model's label set: O, then B- and I- of each entity type (IOB2)."""
        return ("O", *(f"{k}-{t}" for t in self.entity_types for k in ("B", "I")))

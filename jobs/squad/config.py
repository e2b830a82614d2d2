"""Typed config of the `squad` stage. Defaults follow the BERT paper's SQuAD recipe (section 4.2/4.3:
batch 32, learning rate 5e-5 or 3e-5, 2-3 epochs; max_seq_length 384, doc_stride 128, max_query_length 64,
n-best 20, max answer 30 tokens as in google-research/bert run_squad)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bertpipe.jobs.tuning.recipe import Recipe
from bertpipe.jobs.squad.data import article_range
from bertpipe.pipeline.framework.config_fields import at_least, one_of, path_field


@dataclass(frozen=True, kw_only=True)
class SquadConfig(Recipe):
    SECTION: ClassVar[str] = "squad"

    # Any SQuAD-format JSON (v1.1 or v2.0), local or a URI. A user with the full train set points at it.
    train_file: str = path_field()
    eval_file: str = path_field()
    # Article ranges [start, end) of each file (empty = all): how one file is split by article ([0, 38] and
    # [38, 48] for the dev set). A list, not "0:38": YAML 1.1 reads 0:38 as a base-60 integer.
    train_articles: tuple[int, ...] = ()
    eval_articles: tuple[int, ...] = ()
    # "auto": v2.0 when the eval file says so or holds unanswerable questions.
    version: str = "auto"
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = 20
    max_answer_length: int = 30
    # One n-best evaluation of the eval set after the last epoch (each costs a pass over every window); set
    # true (with select: best) to pick the epoch on it.
    eval_each_epoch: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("squad", self, "version", ("auto", "1.1", "2.0"))
        at_least("squad", self, 1, "doc_stride", "max_query_length", "n_best_size", "max_answer_length")
        if self.max_query_length + 3 >= self.max_seq_length:
            raise ValueError(f"squad.max_query_length {self.max_query_length} leaves no room for the context in "
                             f"max_seq_length {self.max_seq_length}")
        article_range(self.train_articles, "squad.train_articles")
        article_range(self.eval_articles, "squad.eval_articles")

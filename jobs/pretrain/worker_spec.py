"""What the pre-training driver hands every worker (Ray Train's train_loop_config)."""
from __future__ import annotations

from dataclasses import dataclass, field

from bertpipe.jobs.pretrain.config import ModelConfig, PretrainConfig
from bertpipe.pipeline.framework.progress import Reporter


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the driver hands every worker; every path in it is absolute or a URI."""

    pretrain: PretrainConfig
    model: ModelConfig
    seed: int
    vocab_tokens: list[str]
    vocab_bytes: bytes
    tracking: dict[str, str]
    export_uri: str
    storage_path: str
    run_name: str
    progress: Reporter = field(default_factory=Reporter)  # the driver's live progress line (rank 0 reports)
    rows: dict[str, int] = field(default_factory=dict)  # {"train_128": rows, "heldout_128": rows, ...}
    heldout: dict[int, str] = field(default_factory=dict)  # seq length -> held-out shard (read by heldout.py)
    # seq length -> training shards: an elastic run's workers read them themselves (data/shared_order.py)
    train_shards: dict[int, list[str]] = field(default_factory=dict)
    init: str = ""  # pretrain.init: the BERT folder every worker loads its weights from (init.py), "" = random
    init_config: dict = field(default_factory=dict)  # its config.json: the model's shape

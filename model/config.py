"""BERT hyper-parameters: one frozen, keyword-only dataclass and the named presets.

Field names follow Hugging Face's `BertConfig` so that `config.json` converts both ways without a
renaming table. Sizes of the paper (Devlin et al., 2018, section 3): BASE is L=12, H=768, A=12 (110M
parameters), LARGE is L=24, H=1024, A=16 (340M); the feed-forward size is always 4H.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Only the sizes differ between presets; everything else keeps the dataclass defaults (GELU, dropout 0.1,
# 512 positions, 2 segment types, truncated-normal 0.02 init). `tiny`, `bert-tiny` and `mini` are not in the
# paper: `tiny` keeps unit tests in seconds; `bert-tiny` and `mini` are Turc et al.'s (2019) BERT-Tiny and
# BERT-Mini, the sizes a laptop CPU pre-trains in minutes (configs/mini.yaml uses BERT-Tiny: it learns more per
# CPU-second on the sample, benchmarks/README.md).
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "bert-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}

# config.json keys we write but do not keep as fields, and the only values we can honour for them.
_HF_FIXED = {"hidden_act": "gelu", "position_embedding_type": "absolute"}


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    vocab_size: int = 30522  # real vocabulary (lines of vocab.txt); logits always have this many columns
    hidden_size: int = 768  # H
    num_hidden_layers: int = 12  # L
    num_attention_heads: int = 12  # A
    intermediate_size: int = 3072  # feed-forward size, 4H
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02  # std of the truncated normal (cut at 2 std, as tf.truncated_normal)
    layer_norm_eps: float = 1e-12
    # The token embedding (and the tied output projection) get rows up to the next multiple of this, so the
    # vocabulary matmul has aligned shapes on tensor cores. Pad rows are zero and never predicted. 1 = off.
    pad_vocab_to_multiple_of: int = 8
    # Recompute each encoder layer's activations in the backward pass instead of storing them.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size",
                     "pad_vocab_to_multiple_of"):
            if getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token embedding: vocab_size rounded up to pad_vocab_to_multiple_of."""
        from bertpipe.model.training import round_up

        return round_up(self.vocab_size, self.pad_vocab_to_multiple_of)

    @classmethod
    def preset(cls, name: str, **overrides) -> BertConfig:
        """`BertConfig.preset("base", vocab_size=len(vocab))`; unknown preset or field → ValueError."""
        if name not in PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; valid presets: {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown BertConfig field(s) {unknown}; valid fields: {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_hf_dict(self) -> dict:
        """config.json contents that `transformers.BertConfig` (and so `from_pretrained`) accepts."""
        d = dataclasses.asdict(self)
        return {
            "architectures": ["BertForPreTraining"],
            "model_type": "bert",
            **{k: d[k] for k in d if k not in ("pad_vocab_to_multiple_of", "activation_checkpointing")},
            **_HF_FIXED,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            # Ours, ignored by transformers; kept so a round trip through config.json is lossless.
            "pad_vocab_to_multiple_of": self.pad_vocab_to_multiple_of,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> BertConfig:
        """Read a Hugging Face BERT config.json dict; keys we do not model are ignored unless they change
        the architecture (another activation or position embedding type) → ValueError."""
        if d.get("model_type", "bert") != "bert":
            raise ValueError(f"config.json has model_type {d['model_type']!r}, expected 'bert'")
        for key, value in _HF_FIXED.items():
            if d.get(key, value) != value:
                raise ValueError(f"config.json has {key}={d[key]!r}; only {value!r} is supported")
        fields = {f.name for f in dataclasses.fields(cls)} - {"activation_checkpointing"}
        return cls(**{k: d[k] for k in fields if k in d})

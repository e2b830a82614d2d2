"""BERT (Devlin et al., 2018) in plain PyTorch, read top to bottom:
embeddings → attention → feed-forward → layer → encoder → pooler → BertModel → heads.

Shapes: B batch, T sequence length, H hidden size, A heads, D = H/A head size, I feed-forward size,
V vocabulary size (config.vocab_size), Vp padded vocabulary rows, P masked-position slots per sequence.

Where this differs from the paper / the original TensorFlow code, on purpose:
- Query, key and value are one fused H→3H linear (one matmul instead of three). The weights are the same
  numbers: hf_format.py splits and joins them under the usual query/key/value names.
- Attention is torch's `scaled_dot_product_attention` (flash / memory-efficient kernels where available)
  with an additive padding mask; the math is the paper's, the attention matrix is never materialised.
- The token embedding has `config.padded_vocab_size` rows (vocabulary rounded up to a multiple of 8, for
  aligned matmuls). Pad rows start at zero, are never looked up, and are sliced off the logits, so they
  are never predicted and receive no gradient. Exports drop them.
- In pre-training the MLM head (transform + tied projection onto the vocabulary) runs only on the gathered
  masked positions, never on every token — as the original code does and Hugging Face's does not.
  The MLM loss is the mean over labelled positions (label -100 = ignore), as the original's weighted mean.
- LayerNorm and the loss are computed in fp32 whatever the activation dtype (bf16/fp16-safe); softmax
  happens inside SDPA, whose kernels accumulate in fp32.
- No `padding_idx` on the token embedding (the original has none; Hugging Face freezes the [PAD] row).
- Token-classification and QA models have no pooler (as in Hugging Face): a parameter that gets no
  gradient breaks DistributedDataParallel.
- Optional activation checkpointing per encoder layer (`config.activation_checkpointing`).
Everything else follows the paper: learned absolute positions, post-LayerNorm residual blocks, exact
(erf) GELU, dropout 0.1 on embeddings / attention probabilities / block outputs, tanh pooler on [CLS],
MLM projection tied to the token embedding with its own output bias, truncated-normal(0.02) init.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bertpipe.model.config import BertConfig

IGNORE_INDEX = -100  # label value of positions that carry no loss (as torch's cross_entropy default)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and cast back, so bf16/fp16 activations keep a stable variance."""

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class Embeddings(nn.Module):
    """token + segment + position embeddings → LayerNorm → dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        H = config.hidden_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, H)  # [Vp, H], tied to the MLM output
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, H)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, H)
        self.norm = LayerNorm(H, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)  # [T], broadcast over the batch
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions))  # [B, T, H]
        return self.dropout(self.norm(x))


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention; returns the output projection (before dropout/residual)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(H, 3 * H)  # rows: [query; key; value]
        self.out = nn.Linear(H, H)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        B, T, H = x.shape
        A = self.num_heads
        q, k, v = self.qkv(x).view(B, T, 3, A, H // A).permute(2, 0, 3, 1, 4).unbind(0)  # 3 × [B, A, T, D]
        # mask: [B, 1, 1, T] additive (0 = attend, very negative = padding key), broadcast over heads/queries.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout_p if self.training else 0.0)  # [B, A, T, D]
        return self.out(y.transpose(1, 2).reshape(B, T, H))  # [B, T, H]


class FeedForward(nn.Module):
    """H → I → H with exact GELU, applied to every position independently."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # [B, T, I] → [B, T, H]


class EncoderLayer(nn.Module):
    """Post-LN transformer block: x = LN(x + drop(attn(x))); x = LN(x + drop(ffn(x)))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.ffn_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, mask)))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))  # [B, T, H]


class Encoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.activation_checkpointing = config.activation_checkpointing

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keeps only the layer's input; the backward reruns the layer (dropout RNG state restored).
                x = checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = layer(x, mask)
        return x


class Pooler(nn.Module):
    """tanh(W · h_[CLS] + b): the sentence vector the NSP and sentence-level heads read."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output: Tensor) -> Tensor:
        return torch.tanh(self.dense(sequence_output[:, 0]))  # [B, H]


def init_weights(module: nn.Module, std: float) -> None:
    """Truncated normal (cut at ±2 std, like tf.truncated_normal_initializer) for matrices and
    embeddings; zero biases; LayerNorm = identity. Vocabulary pad rows are zeroed by the embedding owner."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.trunc_normal_(module.weight, mean=0.0, std=std, a=-2 * std, b=2 * std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class EncoderOutput(NamedTuple):
    """What BertModel returns (the field names are transformers' own)."""

    last_hidden_state: Tensor  # [B, T, H]
    pooler_output: Tensor | None  # [B, H]: tanh(dense([CLS])); None without a pooling layer


class BertModel(nn.Module):
    """Embeddings + encoder (+ pooler). forward → EncoderOutput."""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if add_pooling_layer else None
        self.apply(lambda m: init_weights(m, config.initializer_range))
        with torch.no_grad():
            self.embeddings.word_embeddings.weight[config.vocab_size:].zero_()

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> EncoderOutput:
        """input_ids, token_type_ids [B, T] long; attention_mask [B, T] with 1/True = real token, 0 = pad."""
        if input_ids.size(1) > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.size(1)} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)  # [B, T, H]
        mask = None
        if attention_mask is not None:
            # Additive rather than boolean: a row with no real key (an all-pad filler sequence) then gets
            # uniform attention instead of NaN.
            # Built in the dtype attention will run in (autocast's, if on): fp32's minimum would be -inf
            # in fp16.
            device_type = x.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
            keep = attention_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, T]
            mask = torch.zeros(keep.shape, dtype=dtype, device=x.device).masked_fill(~keep, torch.finfo(dtype).min)
        sequence_output = self.encoder(x, mask)  # [B, T, H]
        pooled = self.pooler(sequence_output) if self.pooler is not None else None
        return EncoderOutput(sequence_output, pooled)


# ----------------------------------------------------------------------------------------- heads


class MaskedLMHead(nn.Module):
    """dense → GELU → LayerNorm → projection onto the vocabulary with the token-embedding matrix (tied)
    plus an output bias. Returns logits with exactly config.vocab_size columns."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # The same Parameter object as the embedding (registered here too, so ZeRO-3 gathers it for this
        # module's forward); parameters() lists it once.
        self.decoder_weight = word_embeddings.weight  # [Vp, H]
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))  # [Vp]

    def forward(self, h: Tensor) -> Tensor:
        h = self.norm(F.gelu(self.dense(h)))  # [..., H]
        logits = F.linear(h, self.decoder_weight, self.bias)  # [..., Vp]
        return logits[..., : self.vocab_size]  # [..., V]: pad rows are never predicted


@dataclass
class PreTrainingOutput:
    """Losses are None when their labels are not given; counts are detached (for accuracy metrics)."""

    loss: Tensor | None = None  # mlm_loss + nsp_loss (or whichever is given)
    mlm_loss: Tensor | None = None  # mean cross-entropy over labelled masked positions
    nsp_loss: Tensor | None = None
    mlm_logits: Tensor | None = None  # [B, P, V] at masked_positions, or [B, T, V] without them
    nsp_logits: Tensor | None = None  # [B, 2]: 0 = IsNext, 1 = NotNext
    mlm_correct: Tensor | None = None  # number of labelled positions predicted right
    mlm_count: Tensor | None = None  # number of labelled positions
    nsp_correct: Tensor | None = None


def _cross_entropy_fp32(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(mean loss over labels != IGNORE_INDEX, number right, number labelled); logits [N, C], labels [N].
    Empty → loss 0 (not NaN), so a batch without masked tokens does not poison the run."""
    labelled = labels != IGNORE_INDEX
    count = labelled.sum()
    total = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & labelled).sum()
    return total / count.clamp(min=1), correct, count


class BertForPreTraining(nn.Module):
    """BERT + masked-LM head + next-sentence head (on the pooled [CLS] vector)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.mlm = MaskedLMHead(config, self.bert.embeddings.word_embeddings)
        self.nsp = nn.Linear(config.hidden_size, 2)
        for head in (self.mlm, self.nsp):
            head.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor,
                masked_positions: Tensor | None = None, masked_lm_labels: Tensor | None = None,
                next_sentence_label: Tensor | None = None) -> PreTrainingOutput:
        """masked_positions [B, P] long (pad slots 0), masked_lm_labels [B, P] (-100 = ignore), or, without
        masked_positions, [B, T]; next_sentence_label [B] long (0 = IsNext, 1 = NotNext)."""
        encoded = self.bert(input_ids, token_type_ids, attention_mask)
        sequence_output, pooled = encoded.last_hidden_state, encoded.pooler_output  # [B, T, H], [B, H]
        if masked_positions is not None:
            B, P = masked_positions.shape
            index = masked_positions.unsqueeze(-1).expand(B, P, sequence_output.size(-1))  # [B, P, H]
            sequence_output = sequence_output.gather(1, index)  # [B, P, H]
        mlm_logits = self.mlm(sequence_output)  # [B, P, V] (or [B, T, V])
        nsp_logits = self.nsp(pooled)  # [B, 2]
        out = PreTrainingOutput(mlm_logits=mlm_logits, nsp_logits=nsp_logits)
        if masked_lm_labels is not None:
            out.mlm_loss, out.mlm_correct, out.mlm_count = _cross_entropy_fp32(
                mlm_logits.flatten(0, -2), masked_lm_labels.flatten())
        if next_sentence_label is not None:
            out.nsp_loss, out.nsp_correct, _ = _cross_entropy_fp32(nsp_logits, next_sentence_label.flatten())
        losses = [x for x in (out.mlm_loss, out.nsp_loss) if x is not None]
        out.loss = sum(losses[1:], losses[0]) if losses else None
        return out


class ClassifierOutput(NamedTuple):
    """What the sequence and token classifiers return."""

    loss: Tensor | None  # None without labels
    logits: Tensor  # [B, num_labels] per sequence, [B, T, num_labels] per token


class SpanOutput(NamedTuple):
    """What BertForQuestionAnswering returns."""

    loss: Tensor | None  # mean of the start and end cross-entropies; None without positions
    start_logits: Tensor  # [B, T]
    end_logits: Tensor  # [B, T]


class BertForSequenceClassification(nn.Module):
    """dropout → linear on the pooled [CLS] vector. num_labels == 1 → regression with MSE (STS-B),
    otherwise cross-entropy. forward → ClassifierOutput (logits [B, num_labels])."""

    def __init__(self, config: BertConfig, num_labels: int):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        self.config = config
        self.num_labels = num_labels
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor,
                labels: Tensor | None = None) -> ClassifierOutput:
        pooled = self.bert(input_ids, token_type_ids, attention_mask).pooler_output
        logits = self.classifier(self.dropout(pooled))  # [B, num_labels]
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.long())
        return ClassifierOutput(loss, logits)


class BertForTokenClassification(nn.Module):
    """dropout → linear on every token (NER-style tagging). labels [B, T] with -100 = ignore (pads,
    word-piece continuations). forward → ClassifierOutput (logits [B, T, num_labels])."""

    def __init__(self, config: BertConfig, num_labels: int):
        super().__init__()
        if num_labels < 2:
            raise ValueError(f"token classification needs num_labels >= 2, got {num_labels}")
        self.config = config
        self.num_labels = num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor,
                labels: Tensor | None = None) -> ClassifierOutput:
        sequence_output = self.bert(input_ids, token_type_ids, attention_mask).last_hidden_state
        logits = self.classifier(self.dropout(sequence_output))  # [B, T, num_labels]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        return ClassifierOutput(loss, logits)


class BertForQuestionAnswering(nn.Module):
    """Span extraction (SQuAD): a linear H → 2 gives start and end logits per token.
    forward → SpanOutput. Positions outside [0, T) are ignored (answer truncated away)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        init_weights(self.qa_outputs, config.initializer_range)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor,
                start_positions: Tensor | None = None,
                end_positions: Tensor | None = None) -> SpanOutput:
        sequence_output = self.bert(input_ids, token_type_ids, attention_mask).last_hidden_state
        start_logits, end_logits = self.qa_outputs(sequence_output).unbind(-1)  # [B, T] each
        loss = None
        if start_positions is not None and end_positions is not None:
            T = input_ids.size(1)

            def span_loss(logits: Tensor, positions: Tensor) -> Tensor:
                positions = positions.flatten()
                positions = positions.masked_fill((positions < 0) | (positions >= T), IGNORE_INDEX)
                return F.cross_entropy(logits.float(), positions, ignore_index=IGNORE_INDEX)

            loss = (span_loss(start_logits, start_positions) + span_loss(end_logits, end_positions)) / 2
        return SpanOutput(loss, start_logits, end_logits)

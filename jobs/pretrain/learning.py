"""Is pre-training learning anything? The baselines a held-out accuracy must beat, and the curves that show it.

- MLM baseline: always predict the token most frequent among the *training* rows' maskable tokens, scored on the
  held-out rows' masked targets drawn exactly as the final evaluation draws them (token-level 15%, the caps).
- NSP baseline: always predict the training rows' majority label, scored on the held-out rows.
- Curves: training loss and accuracy per logging window, held-out accuracy per evaluation, the baselines as
  lines; one PNG each for loss and accuracy (matplotlib, no display needed).

Driver-side, pure numpy/pyarrow: a test calls it on shards it wrote itself.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from bertpipe.jobs.pretrain.masking import IGNORE_INDEX, MaskingSpec, collate
from bertpipe.pipeline import storage

BASELINE_SEED = 20_191  # any fixed value: the baseline's masks are the same on every run
# Bounds that keep the driver's work small on a full Wikipedia run; the commonest token and label of a few
# shuffled shards are those of all of them.
MAX_TRAIN_SHARDS = 4
MAX_HELDOUT_ROWS = 20_000


def _read(uri: str, columns: list[str]):
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as f:
        return pq.read_table(f, columns=columns)


def token_counts(uris: list[str], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in the shards' input_ids (int64 [vocab_size])."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for uri in uris:
        flat = _read(uri, ["input_ids"]).column("input_ids").combine_chunks().flatten()
        counts += np.bincount(flat.to_numpy(zero_copy_only=False).astype(np.int64), minlength=vocab_size)
    return counts


def nsp_labels(uris: list[str]) -> np.ndarray:
    return np.concatenate([_read(u, ["next_sentence_label"]).column("next_sentence_label").to_numpy()
                           for u in uris]).astype(np.int64)


def heldout_targets(uri: str, spec: MaskingSpec, batch_size: int = 256) -> np.ndarray:
    """The held-out MLM targets (token ids) of one masking pass with a fixed seed."""
    table = _read(uri, ["input_ids", "segment_b_start", "next_sentence_label"]).slice(0, MAX_HELDOUT_ROWS)
    rng = np.random.default_rng(BASELINE_SEED)
    targets = []
    for start in range(0, table.num_rows, batch_size):
        part = table.slice(start, batch_size)
        batch = {"input_ids": part.column("input_ids").to_pylist(),
                 "segment_b_start": part.column("segment_b_start").to_numpy(),
                 "next_sentence_label": part.column("next_sentence_label").to_numpy()}
        labels = collate(batch, spec, rng)["masked_lm_labels"].numpy()
        targets.append(labels[labels != IGNORE_INDEX])
    return np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)


def baselines(train_uris: list[str], heldout_uri: str, spec: MaskingSpec) -> dict[str, float]:
    """Held-out accuracy of the two trivial predictors, plus which token and label they predict."""
    train_uris = train_uris[:MAX_TRAIN_SHARDS]
    counts = token_counts(train_uris, spec.vocab_size)
    counts[list(spec.special_ids)] = 0  # never a target
    top = int(np.argmax(counts))
    targets = heldout_targets(heldout_uri, spec)
    majority = int(np.bincount(nsp_labels(train_uris), minlength=2).argmax())
    held_nsp = nsp_labels([heldout_uri])[:MAX_HELDOUT_ROWS]
    return {"baseline_mlm_accuracy": float((targets == top).mean()) if len(targets) else 0.0,
            "baseline_mlm_token_id": float(top), "baseline_mlm_targets": float(len(targets)),
            "baseline_nsp_accuracy": float((held_nsp == majority).mean()) if len(held_nsp) else 0.0,
            "baseline_nsp_label": float(majority)}


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(h["step"], h[key]) for h in history if key in h]
    return [p[0] for p in points], [p[1] for p in points]


def _figure(history: list[dict[str, Any]], lines: list[tuple[str, str]], hlines: list[tuple[str, float]],
            ylabel: str, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or a Ray worker
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for key, label in lines:
        steps, values = _series(history, key)
        if steps:
            ax.plot(steps, values, marker="o" if key.startswith("eval_") else None, markersize=4, label=label)
    for label, value in hlines:
        ax.axhline(value, linestyle="--", linewidth=1, color="grey")
        ax.annotate(label, (0, value), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def curve_pngs(history: list[dict[str, Any]], base: dict[str, float]) -> dict[str, bytes]:
    """{file name: PNG bytes} of the loss and the accuracy curves."""
    loss = _figure(history, [("loss", "train loss (MLM + NSP)"), ("mlm_loss", "train MLM loss"),
                             ("eval_mlm_loss", "held-out MLM loss")], [], "loss", "pre-training loss")
    mlm = base["baseline_mlm_accuracy"]
    hlines = [(f"most-frequent-token MLM baseline {mlm:.3f}", mlm), (f"3x that baseline {3 * mlm:.3f}", 3 * mlm),
              (f"majority NSP baseline {base['baseline_nsp_accuracy']:.3f}", base["baseline_nsp_accuracy"])]
    acc = _figure(history, [("mlm_accuracy", "train MLM"), ("nsp_accuracy", "train NSP"),
                            ("eval_mlm_accuracy", "held-out MLM"), ("eval_nsp_accuracy", "held-out NSP")],
                  hlines, "accuracy", "pre-training accuracy")
    return {"curve_loss.png": loss, "curve_accuracy.png": acc}

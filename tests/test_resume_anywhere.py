"""A run's identity is what changes its result, not its layout (jobs/pretrain/runs.py; issue 33 items 1, 2 and 4): the
name's arithmetic on plain configs; the data rule of a resume on another layout
(jobs/pretrain/checkpointing/resume.py) on positions, on streams of numbered rows and through the loop's own
run_epoch (one CPU process, no Ray); what `bertpipe status` says a run started from; then real Ray Train + DeepSpeed
runs (tiny BERT, 2 CPU workers, local Ray): a run that failed at step 25 resumes from its step-20 checkpoint after
the cadence and CPUs changed, says so in one line with both layouts; a changed learning rate starts at step 0 naming
the field (the stage's decision and line, without training); `pretrain.restart` starts again; and its step-20
checkpoint resumed on one worker instead of two under ZeRO 1 goes on by the rule (the optimizer state
re-partitioned, the rest of the epoch left out: tests/test_repartition.py shows the re-partitioned state exact).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bertpipe.jobs.pretrain import runs

from bertpipe.jobs.pretrain.checkpointing import resume
from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
from bertpipe.jobs.pretrain.checkpointing.resume import Position
from bertpipe.jobs.pretrain.checkpointing.folders import survey
from bertpipe.jobs.pretrain.runs import describe_start
from bertpipe.jobs.pretrain.stage import latest_start, run_name, run_stage, start_record
from bertpipe.jobs.workflow.planning import context as workflow_context
from pretrain_helpers import context, make_inputs, tiny_config


def ident(**pretrain):
    phase = pretrain.pop("phase", {})
    cfg = PretrainConfig(**{"phases": (PhaseConfig(**phase),), **pretrain})
    return runs.identity({"model": ModelConfig(), "pretrain": cfg}, 7, {"pairs": "p1", "vocab": "v1"})


def test_layout_fields_keep_the_name_and_result_fields_change_it():
    base = runs.base_name(ident())
    for layout in (dict(num_workers=2), dict(cpus_per_worker=4), dict(log_every_steps=3), dict(eval_every_steps=7),
                   dict(checkpoint_every_steps=5), dict(prefetch_batches=9), dict(max_failures=0),
                   dict(compile=True), dict(phase={"micro_batch_size": 4})):
        assert runs.base_name(ident(**layout)) == base, layout
    for result in (dict(max_steps=61), dict(zero_stage=2), dict(optimizer="lamb"), dict(masked_lm_prob=0.2),
                   dict(phase={"learning_rate": 2e-4}), dict(phase={"global_batch_size": 64})):
        assert runs.base_name(ident(**result)) != base, result
    assert runs.changes(ident(), ident(phase={"learning_rate": 2e-4}, max_steps=80)) == [
        "pretrain.max_steps 60 → 80", "pretrain.phases[0].learning_rate 0.0001 → 0.0002"]


def test_restart_takes_the_next_name_and_later_reruns_resume_it():
    assert runs.choose_name("pretrain-a", [], restart=False) == "pretrain-a"
    assert runs.choose_name("pretrain-a", ["pretrain-a"], restart=True) == "pretrain-a-r2"
    assert runs.choose_name("pretrain-a", ["pretrain-a", "pretrain-a-r2", "pretrain-b"], False) == "pretrain-a-r2"
    assert runs.choose_name("pretrain-a", ["pretrain-a", "pretrain-a-r2"], restart=True) == "pretrain-a-r3"


def test_another_worker_count_or_micro_batch_is_resumed_and_only_another_zero_stage_refused_in_one_line():
    then = runs.layout_of(2, [8], 1)
    for now in (runs.layout_of(1, [8], 1), runs.layout_of(2, [4], 1), runs.layout_of(4, [2], 1)):
        runs.check_layout(then, now, 20)  # converted: repartition.py, resume.py
    runs.check_layout(None, runs.layout_of(1, [8], 3), 20)  # a checkpoint without a layout: as before
    with pytest.raises(ValueError, match=r"^pretrain: the step-20 checkpoint .* under ZeRO 1, now ZeRO 3: .* another "
                                         r"pretrain.run_name$"):
        runs.check_layout(then, runs.layout_of(1, [8], 3), 20)


# 3200 training rows (4 shards of 800), 32 sequences a step: a worker's share is 1600 rows on 2 workers.
ROWS = {"train_32": 3200}


def rule_config(**kw) -> PretrainConfig:
    return tiny_config(max_steps=200, **kw)  # seq 32, global batch 32, micro 8


def test_the_same_layout_goes_on_where_it_stopped():
    cfg, two = rule_config(), runs.layout_of(2, [8], 1)
    at = Position(step=20, epoch=0, batch=40, sequences=320, dealt=8)
    plan = resume.resume_plan(at, two, two, cfg, ROWS)
    assert plan.position == at and not plan.repartition and plan.left_out == 0 and not plan.recut
    assert plan.carries == ("weights, optimizer state, LR schedule position and step 20 carry over exactly, and so "
                            "does the data position")


def test_another_micro_batch_goes_on_with_the_sequences_not_trained_yet_re_cut():
    cfg, then, now = rule_config(), runs.layout_of(2, [8], 1), runs.layout_of(2, [4], 1)
    at = Position(step=20, epoch=3, batch=40, sequences=320, dealt=8)
    plan = resume.resume_plan(at, then, now, cfg, ROWS)
    assert plan.position == at and plan.recut == 4 and plan.left_out == 0 and not plan.repartition
    assert "re-cut from micro-batches of 8 into 4" in plan.carries and "not trained yet, in their order" in plan.carries
    # back to micro 8 after a checkpoint of the re-cut epoch: 324 is no whole number of micro-batches of 8
    again = resume.resume_plan(Position(step=21, epoch=3, batch=41, sequences=324, dealt=8), now, then, cfg, ROWS)
    assert again.recut == 8 and again.position.sequences == 324


def test_another_worker_count_leaves_out_the_rest_of_the_epoch_and_goes_on_with_the_next():
    cfg = rule_config()
    then, now = runs.layout_of(2, [8], 1), runs.layout_of(1, [8], 1)
    plan = resume.resume_plan(Position(step=20, epoch=0, batch=40, sequences=320, dealt=8), then, now, cfg, ROWS)
    # each of the 2 workers had 1600 rows and trained 320: 2 × 1280 never trained this epoch
    assert plan.position == Position(step=20, epoch=1) and plan.left_out == 2560 and plan.repartition
    assert plan.carries == (
        "weights, optimizer state (re-partitioned from 2 workers to 1), LR schedule position and step 20 carry over "
        "exactly; the data does not: another worker count deals an epoch's rows anew, so the rest of the seq-32 "
        "epoch in progress (2,560 sequences not trained yet) is left out and training goes on with the next epoch (no "
        "sequence of this one trained twice)")
    # 1 → 2: the one worker's share is all 3200 rows
    back = resume.resume_plan(Position(step=20, epoch=0, batch=80, sequences=640, dealt=8), now, then, cfg, ROWS)
    assert back.left_out == 3200 - 640 and back.position == Position(step=20, epoch=1)
    # ZeRO 0 keeps no partitions: the data rule holds, nothing to re-partition
    zero0 = resume.resume_plan(Position(step=20, sequences=320, dealt=8), runs.layout_of(2, [8], 0),
                               runs.layout_of(1, [8], 0), rule_config(zero_stage=0), ROWS)
    assert not zero0.repartition and zero0.left_out == 2560


def test_a_checkpoint_at_an_epoch_start_or_a_phase_end_leaves_nothing_out():
    cfg = rule_config()
    then, now = runs.layout_of(2, [8], 2), runs.layout_of(1, [8], 2)
    at_start = resume.resume_plan(Position(step=50, epoch=1), then, now, cfg, ROWS)
    assert at_start.position == Position(step=50, epoch=1) and at_start.left_out == 0 and at_start.repartition
    assert "the data position is an epoch's start" in at_start.carries
    ended = resume.resume_plan(Position(step=200, epoch=3, batch=40, sequences=320, dealt=8), then, now, cfg, ROWS)
    assert ended.left_out == 0 and ended.position.step == 200


def test_an_older_position_counts_micro_batches_of_its_layout():
    state = {"step": 20, "phase": 0, "epoch": 2, "batch": 40}  # position.json before `sequences` and `dealt`
    assert resume.position_of(state, runs.layout_of(2, [8], 1)) == Position(20, 0, 2, 40, 320, 8)
    assert resume.position_of({"step": 0, "phase": 0, "epoch": 0, "batch": 0}, runs.layout_of(2, [8], 1)) == \
        Position()


def numbered(n: int, size: int, start: int = 0) -> list[dict]:
    return [{"row": np.arange(start + i * size, start + (i + 1) * size),
             "input_ids": np.array([np.arange(3)] * size + [np.arange(2)], dtype=object)[:size]}
            for i in range(n)]


def test_recut_drops_what_was_trained_and_cuts_the_rest_in_order():
    rows = lambda batches: [list(b["row"]) for b in batches]  # noqa: E731
    assert rows(resume.recut(numbered(4, 8), 16, 4)) == [[16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27],
                                                         [28, 29, 30, 31]]
    assert rows(resume.recut(numbered(4, 8), 10, 8)) == [list(range(10, 18)), list(range(18, 26))]  # 6 rows short
    assert rows(resume.recut(numbered(3, 4), 4, 12)) == []  # fewer rows left than a micro-batch
    assert rows(resume.recut(numbered(2, 4), 8, 4)) == []
    assert all(len(b["input_ids"]) == 8 for b in resume.recut(numbered(4, 8), 10, 8))  # every column cut alike


def test_a_micro_batch_change_mid_epoch_trains_every_sequence_of_the_epoch_once(monkeypatch):
    """Through the loop's run_epoch (one process, the product's engine): 3 steps in micro-batches of 8, then the
    rest of the epoch on micro-batches of 4 from that position, then the next epoch: the rows trained, as numbered
    in the stream, are each row of the epoch once, in the stream's order."""
    import engine_helpers as eh
    from bertpipe.jobs.pretrain import loop

    trained = []
    mask_batch = loop.mask_batch
    monkeypatch.setattr(loop, "mask_batch", lambda raw, *a: trained.append(raw["row"].tolist()) or mask_batch(raw, *a))
    base = dict(num_workers=1, max_steps=7, log_every_steps=100, checkpoint_every_steps=10**6, eval_every_steps=0,
                length_bin_window=1)
    eight = tiny_config(**base, phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=16,
                                                    micro_batch_size=8, learning_rate=1e-3, warmup_steps=2),))
    four = eh.single_phase(eight, micro_batch_size=4)
    raw = eh.raw_batches(12, 8, 32)  # an epoch: 96 rows in micro-batches of 8, as dealt
    for i, batch in enumerate(raw):
        batch["row"] = np.arange(i * 8, (i + 1) * 8)

    def run(w, cfg, position, end, batches):
        w = eh.with_config(w, cfg)
        loop.start_phase(w, 0)  # as run_phase: a resume starts on an accumulation boundary
        return loop.run_epoch(w, position, end, batches)

    with eh.process_group():
        w = eh.worker(eight)
        taken = run(w, eight, Position(), 3, raw)
        assert taken == Position(step=3, epoch=0, batch=6, sequences=48, dealt=8)
        goes_on = resume.resume_plan(taken, runs.layout_of(1, [8], 1), runs.layout_of(1, [4], 1), four, {})
        assert goes_on.recut == 4
        end = run(w, four, goes_on.position, 7, raw)  # the epoch runs out before step 7
    assert end == Position(step=6, epoch=0, batch=18, sequences=96, dealt=8)
    assert [len(b) for b in trained] == [8] * 6 + [4] * 12
    assert sum(trained, []) == list(range(96))  # every row once, in order: none twice, none left out


# Each run's fixed cost (Ray Train's workers, DeepSpeed, the end's evaluation and export: ~35 s on 2 cores) is
# most of its time (a step: ~0.3 s); what is asserted needs a checkpoint at 20 and a few steps past it, not more.
STEPS = 30


def config(**kw):
    kw.setdefault("checkpoint_every_steps", 20)
    return tiny_config(max_steps=STEPS, **{"phases": (PhaseConfig(
        max_seq_length=32, max_predictions_per_seq=5, global_batch_size=32, micro_batch_size=8, learning_rate=3e-3,
        warmup_steps=6),), **kw})


@pytest.mark.integration
@pytest.mark.slow  # four pre-training runs
def test_a_failed_run_resumes_after_a_layout_change_and_a_result_change_starts_again(ray_local, tmp_path, faults,
                                                                                    capsys):
    import ray.train

    from bertpipe.pipeline.framework.console import Console

    console = Console(live=True)
    try:
        inputs = make_inputs(tmp_path / "data", lengths=(32,), rows_per_shard=800, num_shards=4, heldout_rows=160)
        faults.arm(step=25, rank=1)
        with pytest.raises(ray.train.TrainingFailedError):
            run_stage(context(tmp_path, inputs, config(max_failures=0), console=console))
        capsys.readouterr()
        # the cadence, the CPUs, the retries and the micro-batch changed: the same run, resumed, the rest of the
        # epoch re-cut into micro-batches of 4 (accumulation 4 instead of 2)
        again = config(max_failures=2, log_every_steps=4, eval_every_steps=0, checkpoint_every_steps=15,
                       cpus_per_worker=1)
        again = dataclasses.replace(again, phases=(dataclasses.replace(again.phases[0], micro_batch_size=4),))
        result = run_stage(context(tmp_path, inputs, again, console=console))
        said = [line for line in capsys.readouterr().out.splitlines() if "pretrain: " in line and "step" in line]
        assert result.metrics["resumed_from_step"] == 20 and result.metrics["step"] == STEPS
        assert any("resuming from the step-20 checkpoint" in line and "taken with 2 workers × micro 8; now 2 "
                   "workers × micro 4" in line and "re-cut from micro-batches of 8 into 4" in line
                   for line in said), said
        # the epoch goes on as dealt (in micro-batches of 8): 30 steps × 16 sequences of each worker's share, in 20
        # steps of 2 micro-batches of 8, then 10 steps of 4 micro-batches of 4
        last = json.loads((Path(result.extra["checkpoint"]) / "position.json").read_text())
        assert (last["epoch"], last["sequences"], last["dealt"], last["batch"]) == (0, STEPS * 16, 8,
                                                                                   20 * 2 + (STEPS - 20) * 4)
        # another learning rate: another run, from step 0, and the line names the field. What run_stage decides
        # before its workers start (the run's folder, the checkpoint to resume, the start line), without a training
        # run of its own: a run's start at step 0 and its line through run_stage are the restart's below.
        changed = dataclasses.replace(config(), phases=(dataclasses.replace(config().phases[0], learning_rate=1e-3),))
        ctx = context(tmp_path, inputs, changed, console=console)
        storage_path = ctx.paths.ray_results
        name = run_name(ctx, changed, storage_path)
        assert name != Path(result.extra["checkpoints"]).name and survey(storage_path, name, changed)[0] is None
        said = describe_start(start_record(ctx, changed, storage_path, name, None, {}))
        assert said.startswith("pretrain: training starts at step 0") and \
            "pretrain.phases[0].learning_rate 0.003 → 0.001" in said, said
        # the first settings again, started over (pretrain.restart) and left unfinished at step 25 (checkpoint 20),
        # then resumed on one worker instead of two under ZeRO 1: the optimizer state re-partitioned, the rest of the
        # epoch left out (the line says how much), and training goes on with the next epoch to the end
        faults.arm(step=25, rank=1)
        with pytest.raises(ray.train.TrainingFailedError):
            run_stage(context(tmp_path, inputs, config(max_failures=0, restart=True), console=console))
        said = [line for line in capsys.readouterr().out.splitlines() if "training starts at step 0" in line]
        assert said and "(pretrain.restart)" in said[0], said
        assert [(k["step"], k["started_at"]) for k in faults.kills] == [(25, 0)]  # its workers began at step 0
        one_worker = dataclasses.replace(config(max_failures=0), num_workers=1)
        result = run_stage(context(tmp_path, inputs, one_worker, console=console))
        said = [line for line in capsys.readouterr().out.splitlines() if "resuming from" in line]
        assert result.metrics["resumed_from_step"] == 20 and result.metrics["step"] == STEPS
        # 3200 rows: each of the 2 workers had 1600 of the epoch and trained 20 steps × 16 of them
        assert len(said) == 1 and all(part in said[0] for part in (
            "resuming from the step-20 checkpoint", "taken with 2 workers × micro 8; now 1 worker × micro 8",
            "started from random initialisation", "optimizer state (re-partitioned from 2 workers to 1), LR schedule "
            "position and step 20 carry over exactly", "(2,560 sequences not trained yet) is left out")), said
        last = json.loads((Path(result.extra["checkpoint"]) / "position.json").read_text())
        assert (last["epoch"], last["sequences"], last["layout"]["num_workers"]) == (1, (STEPS - 20) * 32, 1)
        # `bertpipe status` shows this record: the one the line was made of, in the run folder and the manifest
        start, folder = result.extra["start"], Path(result.extra["checkpoints"])
        assert runs.latest_start(str(folder.parent)) == {**start, "run": folder.name}
        assert runs.describe_start(start) == said[0].strip()
        assert (start["resumed_from_step"], start["layout_then"]["num_workers"], start["layout_now"]["num_workers"],
                start["left_out"], start["started_from"]) == (20, 2, 1, 2560, "random initialisation")
    finally:
        console.close()



def test_status_says_what_pretraining_resumed_or_started_from(tmp_path, capsys):
    """`bertpipe status` reads the start record the stage made its console line and MLflow tags of (stage.py
    start_record): from the run folder (a run in progress, or one that failed), or from the committed manifest."""
    from bertpipe.jobs import cli, workflow
    from bertpipe.pipeline.framework.paths import WorkdirPaths

    workdir = tmp_path / "w"
    args = cli.build_parser().parse_args(["status", "--config", "tiny", "--workdir", str(workdir)])
    storage_path = WorkdirPaths(str(workdir)).ray_results
    started = {"at": 1.0, "started_from": "random initialisation", "layout_now": runs.layout_of(2, [8], 1),
               "resumed_from_step": 0, "why": "no checkpoint of these settings yet"}
    resumed = {"at": 2.0, "started_from": "random initialisation", "layout_now": runs.layout_of(1, [8], 1),
               "resumed_from_step": 20, "checkpoint": f"{storage_path}/pretrain-a/checkpoint_x",
               "layout_then": runs.layout_of(2, [8], 1), "left_out": 2560, "repartitioned": True,
               "carries": "weights, optimizer state (re-partitioned from 2 workers to 1), ... carry over exactly"}
    assert cli.cmd_status(args) == 0 and "latest start" not in capsys.readouterr().out  # nothing started yet
    runs.record(storage_path, "pretrain-a", {"seed": 7}, start=started)
    runs.record(storage_path, "pretrain-a", {"seed": 7}, start=resumed)  # the rerun that resumed it
    row = next(r for r in workflow.status(cli._config(args)) if r["stage"] == "pretrain")
    assert row["start"] == {**resumed, "run": "pretrain-a"}
    assert cli.cmd_status(args) == 0
    shown = [line.strip() for line in capsys.readouterr().out.splitlines() if "latest start" in line]
    assert shown == [f"latest start: resuming from the step-20 checkpoint {storage_path}/pretrain-a/checkpoint_x "
                     "(taken with 2 workers × micro 8; now 1 worker × micro 8; the run started from random "
                     "initialisation): weights, optimizer state (re-partitioned from 2 workers to 1), ... carry over "
                     "exactly"], shown
    # the stage run's MLflow tags are the same record
    from bertpipe.jobs.pretrain.stage import start_tags

    assert start_tags(resumed) == {
        "bertpipe.started_from": "random initialisation", "bertpipe.layout": "1 worker × micro 8",
        "bertpipe.resumed_from_step": "20", "bertpipe.resumed_from_checkpoint": resumed["checkpoint"],
        "bertpipe.resumed_layout": "2 workers × micro 8", "bertpipe.resume_carries": resumed["carries"]}
    assert start_tags(started)["bertpipe.restarted_because"] == "no checkpoint of these settings yet"
    # a committed run newer than the run folder's record (its manifest keeps the same record)
    committed = {**started, "at": 3.0, "started_from": "the weights of /models/bert"}
    cfg = cli._config(args)
    pretrain = next(s for s in workflow.STAGES if s.name == "pretrain")
    ctx = workflow_context(cfg, pretrain, {})
    assert latest_start(ctx, {"extra": {"start": committed}}) == committed
    assert runs.describe_start(committed, "latest start: ") == (
        "latest start: training starts at step 0 from the weights of /models/bert (no checkpoint of these settings "
        "yet)")

"""A run's identity is what changes its result, not its layout (jobs/pretrain/identity.py; issue 33 item 1): the
name's arithmetic on plain configs, then real Ray Train + DeepSpeed runs (tiny BERT, 2 CPU workers, local Ray): a
run that failed at step 30 resumes from its step-20 checkpoint after the cadence and CPUs changed, says so in one
line with both layouts; a changed learning rate starts at step 0 naming the field; `pretrain.restart` starts again;
another worker count is refused in one line (re-partitioning ZeRO state is not done yet)."""
from __future__ import annotations

import dataclasses

import pytest

from bertpipe.jobs.pretrain import identity
from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
from bertpipe.jobs.pretrain.stage import run_stage
from pretrain_helpers import context, make_inputs, tiny_config


def ident(**pretrain):
    phase = pretrain.pop("phase", {})
    cfg = PretrainConfig(**{"phases": (PhaseConfig(**phase),), **pretrain})
    return identity.identity({"model": ModelConfig(), "pretrain": cfg}, 7, {"pairs": "p1", "vocab": "v1"})


def test_layout_fields_keep_the_name_and_result_fields_change_it():
    base = identity.base_name(ident())
    for layout in (dict(num_workers=2), dict(cpus_per_worker=4), dict(log_every_steps=3), dict(eval_every_steps=7),
                   dict(checkpoint_every_steps=5), dict(prefetch_batches=9), dict(max_failures=0),
                   dict(compile=True), dict(phase={"micro_batch_size": 4})):
        assert identity.base_name(ident(**layout)) == base, layout
    for result in (dict(max_steps=61), dict(zero_stage=2), dict(optimizer="lamb"), dict(masked_lm_prob=0.2),
                   dict(phase={"learning_rate": 2e-4}), dict(phase={"global_batch_size": 64})):
        assert identity.base_name(ident(**result)) != base, result
    assert identity.changes(ident(), ident(phase={"learning_rate": 2e-4}, max_steps=80)) == [
        "pretrain.max_steps 60 → 80", "pretrain.phases[0].learning_rate 0.0001 → 0.0002"]


def test_restart_takes_the_next_name_and_later_reruns_resume_it():
    assert identity.choose_name("pretrain-a", [], restart=False) == "pretrain-a"
    assert identity.choose_name("pretrain-a", ["pretrain-a"], restart=True) == "pretrain-a-r2"
    assert identity.choose_name("pretrain-a", ["pretrain-a", "pretrain-a-r2", "pretrain-b"], False) == "pretrain-a-r2"
    assert identity.choose_name("pretrain-a", ["pretrain-a", "pretrain-a-r2"], restart=True) == "pretrain-a-r3"


def test_a_checkpoint_of_another_partitioning_is_refused_in_one_line():
    then = identity.layout_of(2, [8], 1)
    identity.check_layout(then, identity.layout_of(2, [8], 1), 20)
    identity.check_layout(identity.layout_of(2, [8], 0), identity.layout_of(1, [8], 0), 20)  # ZeRO 0: replicas
    with pytest.raises(ValueError, match=r"step-20 checkpoint .* 2 workers, now 1 \(ZeRO 1 .*pretrain.restart=true"):
        identity.check_layout(then, identity.layout_of(1, [8], 1), 20)
    with pytest.raises(ValueError, match=r"micro-batches \[8\], now \[4\]"):
        identity.check_layout(then, identity.layout_of(2, [4], 1), 20)


STEPS = 40


def config(**kw):
    kw.setdefault("checkpoint_every_steps", 20)
    return tiny_config(max_steps=STEPS, **{"phases": (PhaseConfig(
        max_seq_length=32, max_predictions_per_seq=5, global_batch_size=32, micro_batch_size=8, learning_rate=3e-3,
        warmup_steps=6),), **kw})


@pytest.mark.integration
@pytest.mark.slow  # ~2 minutes: four pre-training runs
def test_a_failed_run_resumes_after_a_layout_change_and_a_result_change_starts_again(ray_local, tmp_path, faults,
                                                                                    capsys):
    import ray.train

    from bertpipe.pipeline.framework import progress

    progress.enable(True)
    try:
        inputs = make_inputs(tmp_path / "data", lengths=(32,), rows_per_shard=800, num_shards=4, heldout_rows=160)
        faults.arm(step=30, rank=1)
        with pytest.raises(ray.train.TrainingFailedError):
            run_stage(context(tmp_path, inputs, config(max_failures=0)))
        capsys.readouterr()
        # the cadence, the CPUs and the retries changed: the same run, resumed
        again = context(tmp_path, inputs, config(max_failures=2, log_every_steps=4, eval_every_steps=0,
                                                 checkpoint_every_steps=15, cpus_per_worker=1))
        result = run_stage(again)
        said = [line for line in capsys.readouterr().out.splitlines() if "pretrain: " in line and "step" in line]
        assert result.metrics["resumed_from_step"] == 20 and result.metrics["step"] == STEPS
        assert any("resuming from the step-20 checkpoint" in line and "taken with 2 workers × micro 8; now 2 "
                   "workers × micro 8" in line for line in said), said
        # another learning rate: another run, from step 0, and the line names the field
        changed = dataclasses.replace(config(), phases=(dataclasses.replace(config().phases[0], learning_rate=1e-3),))
        result = run_stage(context(tmp_path, inputs, changed))
        said = [line for line in capsys.readouterr().out.splitlines() if "training starts at step 0" in line]
        assert result.metrics["resumed_from_step"] == 0
        assert len(said) == 1 and "pretrain.phases[0].learning_rate 0.003 → 0.001" in said[0], said
        # the first settings again, started over (pretrain.restart) and left unfinished at step 25 (checkpoint 20),
        # then asked for on one worker instead of two under ZeRO 1: refused before any worker starts, nothing lost
        faults.arm(step=25, rank=1)
        with pytest.raises(ray.train.TrainingFailedError):
            run_stage(context(tmp_path, inputs, config(max_failures=0, restart=True)))
        said = [line for line in capsys.readouterr().out.splitlines() if "training starts at step 0" in line]
        assert said and "(pretrain.restart)" in said[0], said
        with pytest.raises(ValueError, match="taken with 2 workers, now 1"):
            run_stage(context(tmp_path, inputs, dataclasses.replace(config(max_failures=0), num_workers=1)))
    finally:
        progress.enable(False)


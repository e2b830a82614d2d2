"""Goodput under chaos (issue 41 item 4): an elastic pre-training on the multi-node rig (tests/multinode.py: a head
with 0 CPUs and 1-CPU worker nodes, each a real raylet on this host), once undisturbed and once while a node
holding a training worker is killed (its raylet, kill -9) every N seconds, a fresh node joining M seconds after
each kill (or never).

    python benchmarks/bench_chaos.py --kill-every 60 --kills 3 --rejoin-after 30 --json chaos.json
    python benchmarks/bench_chaos.py --kill-every 60 --kills 2 --rejoin-after never --baseline chaos.json

It prints, side by side: wall time, goodput (the undisturbed run's time for the same steps / the disturbed run's),
steps redone, each restart's latency (loss → first new step) split into its parts, and the largest difference of
the two loss curves (MLflow `train/loss`) at equal steps. `--baseline` takes the undisturbed run (and the noise
reference) from an earlier --json file instead of running it again.

Every time comes from the run itself: its log file stamps each progress line (the driver's board, read every 0.5 s)
and each resize line; the bench stamps its own kills and joins and polls the rig until the cluster declares a
killed node dead (detection). The restart/* metrics, where the workers log them, split the rest.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))

# 24 sequences a step over any of 1, 2 or 3 workers (micro-batch 4, accumulation 6, 3 or 2): the global batch of
# every world size the runs pass through is the same (tests/test_elastic_multinode.py's phase).
MICRO, GLOBAL = 4, 24
PHASE = (f"[{{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: {GLOBAL}, "
         f"micro_batch_size: {MICRO}, learning_rate: 1.0e-3, warmup_steps: 2}}]")
# What the workers log about each restart (issue 41 item 3), shown where present.
RESTART_PARTS = ("worker_start_s", "engine_setup_s", "checkpoint_load_s", "compile_s", "first_batch_s", "total_s")
# Ray 2.60's defaults, which neither the rig nor the product changes: a dead raylet is declared dead after
# failure_threshold missed checks, one every period.
HEALTH_CHECKS = "health_check_period_ms 3000, health_check_timeout_ms 10000, health_check_failure_threshold 5"

# ---------------------------------------------------------------------------------------------------- run log

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
PROGRESS = re.compile(r"bertpipe\.progress: pretrain: ([\d,]+)/")
# The driver's resize and restart lines (jobs/pretrain/attempts.py), as the run log stamps them.
RESIZE = re.compile(r"bertpipe\.pretrain: pretrain: (?P<cause>.*?(?P<kind>was lost|workers failed|cluster grew)) "
                    r"at step (?P<reached>\d+)[:;] (?:going on with (?P<workers>\d+) workers? from )?"
                    r"(?:restarted from )?(?:the step-(?P<resumed>\d+) checkpoint|step 0)"
                    r"(?:, accumulation (?P<acc_before>\d+) → (?P<acc_after>\d+))?")


def stamp(line: str) -> float | None:
    """The epoch seconds of a run-log line (the log's local time), None for a line without a stamp."""
    m = STAMP.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3


def progress_points(lines: list[str]) -> list[tuple[float, int]]:
    """(time, step) of every progress line of the run log: the step the board showed then."""
    points = []
    for line in lines:
        m, at = PROGRESS.search(line), stamp(line)
        if m and at is not None:
            points.append((at, int(m.group(1).replace(",", ""))))
    return points


def resize_lines(lines: list[str]) -> list[dict]:
    """Each restart the driver told: when, what ("lost", "grew", "failed"), the step reached, the step resumed from,
    the new worker count and accumulation where it changed."""
    found = []
    for line in lines:
        m, at = RESIZE.search(line), stamp(line)
        if not (m and at is not None):
            continue
        kind = {"was lost": "lost", "cluster grew": "grew", "workers failed": "failed"}[m.group("kind")]
        found.append({"at": at, "kind": kind, "reached": int(m.group("reached")),
                      "resumed": int(m.group("resumed") or 0),
                      "workers": int(m.group("workers")) if m.group("workers") else None,
                      "accumulation": [int(m.group("acc_before")), int(m.group("acc_after"))]
                      if m.group("acc_before") else None,
                      "line": line.split("bertpipe.pretrain: ", 1)[1]})
    return found


def first_point(points: list[tuple[float, int]], after: float, above: int = -1, at_most: int | None = None
                ) -> float | None:
    """When the log first showed, after time `after`, a step above `above` (and at most `at_most`)."""
    for at, step in points:
        if at > after and step > above and (at_most is None or step <= at_most):
            return at
    return None


def training_span(points: list[tuple[float, int]], last_step: int) -> float | None:
    """Seconds from the first step shown to `last_step` shown: the run's training time, start-up left out."""
    first = first_point(points, 0.0, 0)
    last = first_point(points, 0.0, last_step - 1)
    return None if first is None or last is None else last - first


# -------------------------------------------------------------------------------------------------- the figures

def last_per_step(history: list[tuple[float, int, float]]) -> dict[int, float]:
    """{step: value} of a series logged in time order: a step logged again after a restart keeps its last value (the
    one the run went on from)."""
    return {step: value for _, step, value in sorted(history)}


def largest_gap(a: dict[int, float], b: dict[int, float]) -> tuple[int, float] | None:
    """(step, |a - b|) where two curves differ most at a step both logged; None when they share none."""
    shared = sorted(set(a) & set(b))
    if not shared:
        return None
    step = max(shared, key=lambda s: abs(a[s] - b[s]))
    return step, abs(a[step] - b[step])


def first_step_back(points: list[tuple[float, int]], after: float) -> float | None:
    """When the log, after time `after`, first showed a step below one it had shown: a resumed attempt's first."""
    highest = -1
    for at, step in points:
        if at > after and step < highest:
            return at
        highest = max(highest, step)
    return None


def restarts(resizes: list[dict], events: list[dict], points: list[tuple[float, int]],
             parts: dict[str, list[tuple[float, int, float]]]) -> list[dict]:
    """Each restart's latency split into its parts, in seconds after its cause: a loss from the kill (the bench's,
    matched in order), a grow from the node's join. Up to the first step past the one reached: the cluster
    declaring the node dead (detection), the new attempt's first step (attempt), and the steps redone after it
    (redo); a grow's stall runs from the last step of the old attempt. `parts`: the workers' restart/* series,
    matched by time: restart/total_s ends at the attempt's first step and starts when Ray Train started the group."""
    kills = [e for e in events if e["kind"] == "kill"]
    joins = [e for e in events if e["kind"] == "join"]
    used: set[float] = set()
    rows = []
    for r in resizes:
        row = {"kind": r["kind"], "reached": r["reached"], "resumed": r["resumed"], "workers": r["workers"],
               "line": r["line"], "redone_steps": r["reached"] - r["resumed"]}
        if r["kind"] in ("lost", "failed") and kills:
            kill = kills.pop(0)
            since, row["detection_s"] = kill["at"], _minus(kill.get("detected_at"), kill["at"])
            new_step = first_point(points, since, r["reached"])
            # the new attempt's first step: the first shown after the kill below a step shown before it (the old
            # attempt's steps only rise), which may come before the cluster declares the node dead; a step back
            # shown after the first new step is a later restart's: then the polls missed the redo, and the first
            # new step is also the attempt's first shown
            back = first_step_back(points, kill["at"])
            resumed_at = back if back is not None and (new_step is None or back <= new_step) else new_step
        else:  # a grow: told as the new attempt began
            join = max((j for j in joins if j["at"] < r["at"]), key=lambda j: j["at"], default=None)
            since = join["at"] if join else r["at"]
            resumed_at = first_point(points, r["at"])
            stopped = [at for at, _ in points if resumed_at is not None and at < resumed_at]
            row["stall_start"] = stopped[-1] if stopped else None
            new_step = first_point(points, since, r["reached"])
        row["latency_s"], row["attempt_s"] = _minus(new_step, since), _minus(resumed_at, since)
        row["redo_s"] = _minus(new_step, resumed_at)
        if r["kind"] == "grew":
            row["stall_s"] = _minus(new_step, row.pop("stall_start"))
        totals = [p for p in parts.get("total_s", []) if p[0] not in used and p[0] >= since and p[1] > r["resumed"]]
        if totals:
            first = min(totals)
            used.add(first[0])
            for name, series in parts.items():
                row[f"worker_{name}"] = next((v for t, s, v in series if s == first[1] and abs(t - first[0]) < 60),
                                             None)
        rows.append(row)
    return rows


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# ------------------------------------------------------------------------------------------------------ a run

def mlflow_series(db: Path, name: str) -> list[tuple[float, int, float]]:
    """(epoch seconds, step, value) of every point of the series in the run's MLflow store, in time order."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return sorted((p.timestamp / 1e3, p.step, p.value) for r in runs for p in client.get_metric_history(r.info.run_id,
                                                                                                           name))


class LogTail:
    """The run's log file (<workdir>/logs/run-*.log), read as it grows."""

    def __init__(self, workdir: Path):
        self.workdir, self.lines, self._file, self._rest = workdir, [], None, ""

    def read(self) -> list[str]:
        if self._file is None:
            found = sorted((self.workdir / "logs").glob("run-*.log"))
            if not found:
                return self.lines
            self._file = open(found[0], encoding="utf-8", errors="replace")
        text = self._rest + self._file.read()
        *whole, self._rest = text.split("\n")
        self.lines += whole
        return self.lines


def run_once(inputs: Path, home: Path, args, chaos: bool, workers: str) -> dict:
    """One pre-training on a fresh rig of `args.nodes` 1-CPU nodes; with `chaos`, the kills and joins."""
    from multinode import MultiNodeRay
    from test_multinode import Watched, pretrain_args

    home.mkdir(parents=True)
    events: list[dict] = []
    with MultiNodeRay(head_cpus=0, node_cpus=(1,) * args.nodes) as rig:
        started = time.time()
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                    "--set", f"pretrain.max_steps={args.steps}", "--set", f"pretrain.phases={PHASE}",
                                    "--set", f"pretrain.num_workers={workers}",
                                    "--set", f"pretrain.checkpoint_every_steps={args.checkpoint_every}",
                                    "--set", f"pretrain.log_every_steps={args.log_every}",
                                    "--set", f"pretrain.elastic_resize_check_s={args.resize_check_s}",
                                    # every kill is a failure (a grow is none): room for all of them
                                    "--set", f"pretrain.max_failures={args.kills + 2}", mlflow=True), home)
        tail = LogTail(home / "w")
        try:
            if chaos:
                events = make_chaos(rig, run, tail, args)
            code = run.finish(args.timeout)
        finally:
            if run.proc.poll() is None:  # the bench failed: the run goes with the rig, not after it
                run.proc.kill()
        wall = time.time() - started
    lines = tail.read()
    console = run.text()
    if code != 0:
        raise SystemExit(f"the run in {home} failed (exit {code}):\n{console[-3000:]}")
    points = progress_points(lines)
    db = home / "w" / "mlflow.db"
    parts = {name: mlflow_series(db, f"restart/{name}") for name in RESTART_PARTS}
    stalls = [v for _, _, v in mlflow_series(db, "checkpoint/stall_s")]
    uploads = [v for _, _, v in mlflow_series(db, "checkpoint/upload_s")]
    sizes = [int(v) for _, _, v in mlflow_series(db, "train/world_size")]
    resizes = resize_lines(lines)
    return {"workers": workers, "wall_s": wall, "train_s": training_span(points, args.steps),
            "loss": {str(k): v for k, v in last_per_step(mlflow_series(db, "train/loss")).items()},
            "events": events, "restarts": restarts(resizes, events, points, parts),
            "redone_steps": sum(r["reached"] - r["resumed"] for r in resizes),
            "world_sizes": [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]],
            "checkpoint_stall_s": stalls, "checkpoint_upload_s": uploads,
            "console": [line.strip() for line in console.splitlines() if "pretrain:" in line]}


def make_chaos(rig, run, tail: LogTail, args) -> list[dict]:
    """From the first training step on: a node holding a training worker killed every `kill_every` s (later when
    none holds one at that moment: the workers are restarting), a 1-CPU node added `rejoin_after` s after each
    kill; each killed node polled until the cluster declares it dead."""
    events: list[dict] = []
    while not progress_points(tail.read()):
        if run.proc.poll() is not None:
            return events
        time.sleep(0.25)
    start = progress_points(tail.lines)[0][0]
    next_kill, kills, joins, watching = start + args.kill_every, 0, [], None
    while run.proc.poll() is None:
        now = time.time()
        if watching is not None and watching["node"] not in rig.command("nodes")["alive"]:
            watching["detected_at"], watching = time.time(), None
        if kills < args.kills and now >= next_kill:
            busy = rig.busy_nodes()
            if busy:
                killed = rig.kill_node(busy[0])
                watching = {"kind": "kill", "at": killed["at"], "node": killed["killed"],
                            "late_s": killed["at"] - next_kill}
                events.append(watching)
                kills, next_kill = kills + 1, next_kill + args.kill_every
                if args.rejoin_after is not None:
                    joins.append(killed["at"] + args.rejoin_after)
        if joins and now >= joins[0]:
            asked = joins.pop(0)
            node = rig.add_node(1)
            events.append({"kind": "join", "asked": asked, "at": time.time(), "node": node})
        tail.read()
        time.sleep(0.25)
    return events


# ---------------------------------------------------------------------------------------------------- the table

def _s(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def summary_table(base: dict, chaos: dict, noise: dict | None, label: str) -> str:
    """The runs side by side (Markdown)."""
    base_loss = {int(k): v for k, v in base["loss"].items()}
    gap = largest_gap(base_loss, {int(k): v for k, v in chaos["loss"].items()})
    noise_gap = largest_gap(base_loss, {int(k): v for k, v in noise["loss"].items()}) if noise else None
    goodput = base["train_s"] / chaos["train_s"] if base["train_s"] and chaos["train_s"] else None
    kills = [e for e in chaos["events"] if e["kind"] == "kill"]
    rows = [("wall time (process), s", _s(base["wall_s"]), _s(chaos["wall_s"])),
            ("training time (step 1 → last step), s", _s(base["train_s"]), _s(chaos["train_s"])),
            ("goodput (undisturbed training time / this one)", "100%", _s(goodput and 100 * goodput, "{:.0f}%")),
            ("nodes killed / joined", "0 / 0",
             f"{len(kills)} / {sum(e['kind'] == 'join' for e in chaos['events'])}"),
            ("restarts (losses + grows)", "0", f"{len(chaos['restarts'])} "
             f"({sum(r['kind'] != 'grew' for r in chaos['restarts'])} + "
             f"{sum(r['kind'] == 'grew' for r in chaos['restarts'])})"),
            ("steps redone", str(base["redone_steps"]), str(chaos["redone_steps"])),
            ("world size, in turn", " → ".join(map(str, base["world_sizes"])),
             " → ".join(map(str, chaos["world_sizes"]))),
            ("checkpoint stall, mean / max s (`checkpoint/stall_s`)", _mean_max(base["checkpoint_stall_s"]),
             _mean_max(chaos["checkpoint_stall_s"])),
            ("checkpoint upload, mean / max s (`checkpoint/upload_s`)", _mean_max(base.get("checkpoint_upload_s")),
             _mean_max(chaos.get("checkpoint_upload_s"))),
            ("final loss (last logged window)", _s(_final(base), "{:.3f}"), _s(_final(chaos), "{:.3f}")),
            ("largest loss difference at equal steps (vs undisturbed)", "0", _gap(gap, len(base_loss)))]
    if noise_gap is not None:  # the same run on another fixed worker count: the same math in another float order
        rows.append((f"the noise: undisturbed on {noise['workers']} workers vs undisturbed", "",
                     _gap(noise_gap, len(base_loss))))
    head = f"| | undisturbed | {label} |\n|---|---|---|\n"
    return head + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)


def restart_table(chaos: dict) -> str:
    """One row per restart: its latency and where it went, seconds after the loss or the join (Markdown)."""
    head = ["restart", "steps redone", "loss (kill) or join → first new step", "node declared dead",
            "new worker group started", "the attempt's first step", "of which: worker start", "DeepSpeed set-up",
            "checkpoint load", "compile", "first batch", "then redo to the first new step"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in chaos["restarts"]:
        what = (f"{'lost' if r['kind'] != 'grew' else 'grew'} at step {r['reached']} → "
                f"{r['workers'] or 'as many'} workers from step {r['resumed']}")
        latency = _s(r["latency_s"]) if r["kind"] != "grew" else \
            f"{_s(r['latency_s'])} (stall {_s(r.get('stall_s'))})"
        cells = [what, str(r["redone_steps"]), latency, _s(r.get("detection_s")),
                 _s(_minus(r.get("attempt_s"), r.get("worker_total_s"))), _s(r.get("attempt_s")),
                 *(_s(r.get(f"worker_{p}")) for p in RESTART_PARTS[:-1]), _s(r.get("redo_s"))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _gap(gap: tuple[int, float] | None, steps: int) -> str:
    if gap is None:
        return "–"
    return f"{gap[1]:.3f} (step {gap[0]})" if gap[1] else f"0 (identical at all {steps} logged steps)"


def _mean_max(values: list[float] | None) -> str:
    return f"{sum(values) / len(values):.2f} / {max(values):.2f}" if values else "–"


def _final(run: dict) -> float | None:
    return run["loss"][max(run["loss"], key=int)] if run["loss"] else None


def code_state() -> str:
    """The commit the runs ran, and the files changed beside it (the working tree is what ran)."""
    import subprocess

    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--short", "--untracked-files=no"], capture_output=True,
                             text=True).stdout.split("\n")
    return head + "".join(f"; {line.strip()}" for line in changed if line.strip())


# ------------------------------------------------------------------------------------------------------- main

def report(a: dict, base: dict, noise: dict | None, chaos: dict) -> str:
    """The tables and the console lines of the disturbed run; `a`: the bench's arguments."""
    back = "never back" if a["rejoin_after"] is None else f"a node back after {a['rejoin_after']:g} s"
    label = f"a node killed every {a['kill_every']:g} s ({a['kills']}×), {back}"
    return (f"tiny preset, {a['steps']} steps of {GLOBAL} sequences (seq 32), pretrain.num_workers={a['workers']}, "
            f"{a['nodes']} 1-CPU nodes, checkpoint every {a['checkpoint_every']} steps, elastic_resize_check_s "
            f"{a['resize_check_s']:g}, Ray Train's report poll {a.get('report_poll_s', 2.0):g} s; Ray's node health "
            f"checks at their defaults ({HEALTH_CHECKS})\n\n"
            + summary_table(base, chaos, noise, label) + "\n\n" + restart_table(chaos)
            + "\n\nconsole lines:\n" + "\n".join(f"    {line}" for line in chaos["console"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--nodes", type=int, default=3, help="1-CPU worker nodes at the start")
    ap.add_argument("--workers", default="[1, 3]", help="pretrain.num_workers of both runs")
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--rejoin-after", default="30", help="seconds after a kill a fresh node joins, or 'never'")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="pretrain.checkpoint_every_steps")
    ap.add_argument("--log-every", type=int, default=2, help="pretrain.log_every_steps")
    ap.add_argument("--resize-check-s", type=float, default=5, help="pretrain.elastic_resize_check_s")
    ap.add_argument("--noise-workers", type=int, default=0,
                    help="also run undisturbed on this fixed worker count: the run-to-run noise of the loss curve")
    ap.add_argument("--baseline", type=Path, help="take the undisturbed run (and noise) from this --json file")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds a run may take")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--show", type=Path, help="print the tables of this --json file again; run nothing")
    args = ap.parse_args()
    if args.show:
        saved = json.loads(args.show.read_text())
        print(report(saved["args"], saved["undisturbed"], saved.get("noise"), saved["chaos"]))
        return
    args.rejoin_after = None if args.rejoin_after == "never" else float(args.rejoin_after)
    code = code_state()  # as the runs start: the working tree may change while they run

    from pretrain_helpers import make_inputs

    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        root = Path(tmp)
        make_inputs(root / "inputs", lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
        (root / "inputs" / "pairs" / "_MANIFEST.json").unlink()  # shards from anywhere: no manifest of ours
        if args.baseline:
            earlier = json.loads(args.baseline.read_text())
            assert earlier["args"]["steps"] == args.steps, "the baseline ran another number of steps"
            base, noise = earlier["undisturbed"], earlier.get("noise")
        else:
            base = run_once(root / "inputs", root / "undisturbed", args, False, args.workers)
            noise = (run_once(root / "inputs", root / "noise", args, False, str(args.noise_workers))
                     if args.noise_workers else None)
        chaos = run_once(root / "inputs", root / "chaos", args, True, args.workers)

    from bertpipe.jobs.pretrain.controller_env import REPORT_POLL_ENV, REPORT_POLL_S

    args.report_poll_s = float(os.environ.get(REPORT_POLL_ENV, REPORT_POLL_S))  # what the runs' controller had
    text = report(vars(args), base, noise, chaos)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()}, "code": code,
                                         "undisturbed": base, "noise": noise, "chaos": chaos, "table": text},
                                        indent=1))


if __name__ == "__main__":
    main()

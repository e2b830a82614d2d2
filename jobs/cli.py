"""`bertpipe`: one CLI for running the workflow locally or on a cluster, and for watching it."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bertpipe.jobs.services import causes, interrupts
from bertpipe.jobs.services.configtools import ConfigError
from bertpipe.pipeline.framework import redact, storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.stage import StageInputError
from bertpipe.pipeline.framework.workdir_lock import WorkdirBusy


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bertpipe")
    except PackageNotFoundError:  # the code run from a checkout that was never installed
        return "(not installed)"


def _stages_help() -> str:
    """The stages `--only` / `--from` take, from the workflow's own list (opt-in ones named as such)."""
    from bertpipe.jobs.workflow import stages

    default = [s.name for s in stages.STAGES if not s.opt_in]
    opt_in = [s.name for s in stages.STAGES if s.opt_in]
    return ", ".join(default) + (f"; opt-in: {', '.join(opt_in)}" if opt_in else "")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from bertpipe.jobs.config import preset_names

    p.add_argument("--config", default="tiny", metavar="PRESET|FILE",
                   help=f"a preset ({', '.join(preset_names())}: configs/NAME.yaml) or a YAML file (default: tiny)")
    p.add_argument("--workdir", default=None, help="override `workdir` (local path or s3://, gs:// URI)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set pairs.dupe_factor=5 (repeatable)")


def _config(args):
    from bertpipe.jobs.config import load_config

    return load_config(args.config, args.overrides, args.workdir)


class _RunLogFile(logging.FileHandler):
    """The run's log file. A record it cannot write (the disk is full) is dropped silently instead of logging's
    "--- Logging error ---" and a traceback on stderr per record; `failed` says the file is incomplete."""

    failed = ""

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = self.failed or str(sys.exc_info()[1] or "write error")


def _log_file(workdir: str) -> str:
    """Every run also logs, with tracebacks, to a file of its own: <workdir>/logs/run-<time>.log for a local
    workdir; for a remote one (s3://, gs://, any URI), on this machine in <temp dir>/bertpipe-logs/<workdir as a
    name>/run-<time>.log (`tempfile.gettempdir()`: $TMPDIR, else /tmp), copied to <workdir>/logs/ when the run
    ends (_copy_log). "" when a remote workdir's run cannot have that local file (the run goes on without it)."""
    name = time.strftime("run-%Y%m%d-%H%M%S.log")
    if storage.is_remote(workdir):
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", redact.mask(workdir)).strip("-.")[:100] or "workdir"
        path = os.path.join(tempfile.gettempdir(), "bertpipe-logs", slug, name)
    else:
        path = os.path.join(WorkdirPaths(workdir).logs, name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handler = _RunLogFile(path)
    except OSError:
        if not storage.is_remote(workdir):
            raise
        return ""
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return path


def _log_copy_uri(workdir: str, log_path: str) -> str:
    """Where a remote workdir's run leaves a copy of its log file when it ends: <workdir>/logs/run-<time>.log
    ("" for a local workdir, whose log file is there already)."""
    if not log_path or not storage.is_remote(workdir):
        return ""
    return storage.join(WorkdirPaths(workdir).logs, os.path.basename(log_path))


def _copy_log(log_path: str, copy_uri: str, workflow_run: dict[str, str]) -> str:
    """At the end of a remote workdir's run: the log file as it is now, into the workdir (pipeline/framework/storage.py)
    and, when the run was tracked, into the MLflow workflow run's artifacts (logs/). Best effort: "" when the copy
    reached the workdir, else why not (one line); either way the local file stays where it is."""
    if not copy_uri:
        return ""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _RunLogFile) and handler.baseFilename == os.path.abspath(log_path):
            handler.flush()
    try:
        with open(log_path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return _first_line(exc)
    if workflow_run:
        from bertpipe.jobs.services import tracking

        tracking.attach_bytes(workflow_run, data, os.path.basename(log_path), "logs")
    try:
        storage.write_bytes(copy_uri, data)
    except Exception as exc:  # noqa: BLE001 - any store error: the run's own outcome is what the console reports
        logging.getLogger("bertpipe").info("could not copy the log file to %s", copy_uri, exc_info=exc)
        return redact.mask(_first_line(exc))
    return ""


def _traceback_on_stderr(workdir: str) -> bool:
    """Whether a failed run prints the failure's traceback on stderr too, before its closing lines: where the
    workdir is remote, or where the process is a job submitted to a Ray cluster (`bertpipe submit`; Ray's job
    supervisor gives its driver RAY_JOB_CONFIG_JSON_ENV_VAR). There the log file lies on a machine that may be gone
    when someone looks (a cluster node, a pod's scratch disk), while stderr is the job's log: what `ray job logs`,
    `bertpipe jobs logs` and the Ray dashboard show. A local run with a local workdir keeps the three lines: its
    log file, with the traceback, is in the workdir."""
    return storage.is_remote(workdir) or bool(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))


def _print_traceback(exc: BaseException) -> None:
    """The failure's traceback on stderr (colour codes stripped, credentials masked), between two marker lines."""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    print(f"bertpipe: the failure's traceback:\n{redact.mask(causes.strip_ansi(text))}\n"
          "bertpipe: (end of the traceback)", file=sys.stderr, flush=True)


def _log_line(log_path: str, copy_uri: str = "", copy_failed: str = "") -> str:
    failed = next((h.failed for h in logging.getLogger().handlers if isinstance(h, _RunLogFile) and h.failed), "")
    incomplete = f" (incomplete: {redact.mask(failed)})" if failed else ""
    copied = ""
    if copy_uri:
        copied = f" (not copied to {copy_uri}: {copy_failed})" if copy_failed else f" (copied to {copy_uri})"
    return f"full log, with the traceback: {log_path}{incomplete}{redact.mask(copied)}"


def _config_argv(args) -> list[str]:
    """The user's --config, --workdir and --set, for a command the CLI suggests: it must act on the same config."""
    parts = ["--config", args.config]
    if args.workdir:
        parts += ["--workdir", args.workdir]
    for item in args.overrides:
        parts += ["--set", item]
    return parts


_HINT = re.compile(r"`bertpipe (run|status)((?: [^`]*)?)`")


def _with_config(text: str, args) -> str:
    """A message's suggested `bertpipe run ...` / `bertpipe status ...` (the workflow knows no CLI arguments)
    with the user's --config, --workdir and --set put in, so that it acts on the config the user meant."""
    if not hasattr(args, "config"):
        return text

    def carry(m: re.Match) -> str:
        if "--config" in m.group(2):
            return m.group(0)
        return f"`{shlex.join(['bertpipe', m.group(1), *_config_argv(args)])}{m.group(2)}`"

    return _HINT.sub(carry, text)


def _resume_command(args, stage: str | None) -> str:
    """The command that resumes from `stage`; with no stage (the run failed before its first one), the command
    as it was given."""
    parts = ["bertpipe", "run", *_config_argv(args)]
    if stage:
        return shlex.join(parts + ["--from", stage])
    for item in args.only or []:
        parts += ["--only", item]
    return shlex.join(parts + (["--from", args.start] if args.start else []) + (["--force"] if args.force else []))


def _closing_lines(console: Console, args, log_path: str, first: str, stage: str | None, fix: bool = True,
                   copy_uri: str = "", copy_failed: str = "") -> None:
    """The three lines a run that failed or was stopped ends with: what happened, the log (and, for a remote
    workdir, where its copy went), how to resume."""
    console.error(_with_config(first, args))
    if log_path:
        console.error(_log_line(log_path, copy_uri, copy_failed))
    console.error(f"{'after fixing it, ' if fix else ''}resume with: {_resume_command(args, stage)}")


def cmd_run(args) -> int:
    from bertpipe.jobs import workflow
    from bertpipe.pipeline.framework import workdir_lock

    cfg = _config(args)
    # Renamed stages under their new names (warned once, here), so the commands printed later use them too.
    args.only = [",".join(workflow.current_stage_names(part.split(","))) for part in args.only or []] or None
    args.start = workflow.current_stage_names([args.start])[0] if args.start else None
    only = [s for part in (args.only or []) for s in part.split(",") if s]
    selected = workflow.select(only or None, args.start)
    # One run per workdir, from before the first byte is written (the log file) until the process ends: a second
    # run stops here with one line naming the holder. Preflight runs under the lock too, so the manifests it
    # reads are not being rewritten while it reads them.
    with workdir_lock.hold(cfg.workdir, note=lambda line: args.console.error(f"note: {line}")):
        return _run_locked(args, cfg, only, selected)


def _run_locked(args, cfg, only: list[str], selected: list[str]) -> int:
    from bertpipe.jobs import console_lines, next_steps, workflow
    from bertpipe.jobs.services import tracking
    from bertpipe.jobs.config import resolved_tracking_uri

    plans = workflow.preflight(cfg, selected)  # bad input: one line, nothing written
    # An MLflow server that does not answer: one line now, rather than a traceback after MLflow's retries.
    unreachable = tracking.check_server(resolved_tracking_uri(cfg), cfg.mlflow.experiment)
    if unreachable:
        raise StageInputError(f"{unreachable}; start it, point mlflow.tracking_uri (or MLFLOW_TRACKING_URI) at one "
                              "that runs, or set mlflow.tracking_uri=off")
    log_path = _log_file(cfg.workdir)
    copy_uri = _log_copy_uri(cfg.workdir, log_path)
    config_name = Path(args.config).stem
    console = args.console
    console_lines.header(console, cfg, config_name, resolved_tracking_uri(cfg), selected, log_path, copy_uri)
    console.go_live()
    summary = workflow.RunSummary()  # names the workflow's MLflow run once it exists, for a run that fails

    def finish(first: str, stage: str | None, fix: bool = True, failure: BaseException | None = None) -> None:
        """A failed or stopped run: the traceback on stderr where that is the job's log, the log file copied
        beside the outputs (remote workdir), then the closing lines."""
        if failure is not None and _traceback_on_stderr(cfg.workdir):
            _print_traceback(failure)
        failed = _copy_log(log_path, copy_uri, summary.workflow_run)
        _closing_lines(console, args, log_path, first, stage, fix, copy_uri, failed)

    try:
        summary = workflow.run(cfg, only=only or None, start=args.start, force=args.force, verbose=args.verbose,
                               config_name=config_name, plans=plans, console=console, summary=summary)
    except workflow.StageFailed as exc:
        # INFO: into the log file with its traceback; the console gets the three lines below instead (and, where
        # the workdir is remote or this is a submitted Ray job, the traceback first: _traceback_on_stderr).
        logging.getLogger("bertpipe").info("%s", causes.strip_ansi(str(exc)), exc_info=exc.cause)
        if isinstance(exc.cause, BrokenPipeError) and _stdout_closed():  # `bertpipe run | head`: not the stage's fault
            finish(f"stage {exc.stage} stopped: standard output was closed", exc.stage, fix=False)
            return _SIGPIPE_EXIT
        finish(f"stage {exc.stage} failed: {causes.first_line(exc.cause)}", exc.stage, failure=exc.cause)
        return 2 if isinstance(exc.cause, (ConfigError, StageInputError)) else 1
    except KeyboardInterrupt as exc:  # SIGINT, SIGTERM, SIGHUP (services/interrupts.py): cleaned up on the way here
        stage = getattr(exc, "stage", None)
        logging.getLogger("bertpipe").info("run stopped: %s", interrupts.interrupt_text(exc), exc_info=exc)
        finish(f"{f'stage {stage}' if stage else 'run'} {interrupts.interrupt_text(exc)}", stage, fix=False)
        return interrupts.exit_code(exc)
    except (ConfigError, StageInputError):
        raise  # bad input found by the workflow itself: one line (main)
    except Exception as exc:  # noqa: BLE001 - outside any stage (the MLflow store on a full disk, say): same lines
        logging.getLogger("bertpipe").info("run failed outside its stages", exc_info=exc)
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            finish("run stopped: standard output was closed", None, fix=False)
            return _SIGPIPE_EXIT
        finish(f"run failed before or between its stages: {causes.first_line(exc)}", None, failure=exc)
        return 1
    # The summary and GLUE tables, then where everything is and what to do next (jobs/next_steps.py).
    next_steps.show(console, cfg, args, selected, summary, config_name)
    failed = _copy_log(log_path, copy_uri, summary.workflow_run)
    if failed:
        console.error(f"note: the run's log was not copied to {copy_uri} ({failed}); it is at {log_path}")
    return 0


def cmd_status(args) -> int:
    from bertpipe.jobs import workflow
    from bertpipe.jobs.pretrain.runs import describe_start

    rows = workflow.status(_config(args), verify=args.verify)
    rows = redact.mask_data(rows)  # an s3://KEY:SECRET@bucket workdir is shown masked
    for row in rows:
        if row.get("problem"):
            row["problem"] = _with_config(row["problem"], args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return _status_exit(rows, args)
    print(f"{'stage':<9} {'state':<8} {'rows':>10} {'seconds':>9}  output")
    for r in rows:
        secs = f"{r['seconds']:.1f}" if r.get("seconds") is not None else "-"
        print(f"{r['stage']:<9} {r['state']:<8} {str(r['rows'] if r['rows'] is not None else '-'):>10} "
              f"{secs:>9}  {r['output']}" + (f"  ({r['problem']})" if r.get("problem") else ""))
        if r.get("start"):  # what pre-training resumed or started from (jobs/pretrain/stage.py start_record)
            print(f"{'':<9} {describe_start(r['start'], prefix='latest start: ')}")
    return _status_exit(rows, args)


STATUS_CHECK_HELP = ("exit 1 when a stage is broken, else 3 when one is missing (never run, or its output is gone), "
                     "else 0 (every stage fresh or stale); without --check, status exits 0 whenever it could report")


def _status_exit(rows: list[dict], args) -> int:
    """`status --check`: the workdir's state as the exit status (STATUS_CHECK_HELP), for scripts to branch on."""
    if not args.check:
        return 0
    states = {r["state"] for r in rows}
    return 1 if "broken" in states else 3 if "missing" in states else 0


def cmd_config(args) -> int:
    """The config a run with these arguments would use, as YAML of the shape a preset has: every section and
    field, defaults included, every path absolute (or a URI) as the run resolves it; credentials masked."""
    import yaml

    from bertpipe.jobs.config import config_as_dict

    data = redact.mask_data(config_as_dict(_config(args)))
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
    return 0


def cmd_fetch_sample(args) -> int:
    from pathlib import Path

    from bertpipe.pipeline.stages.sample import fetch_sample

    for name, path in fetch_sample(Path(args.dest)).items():
        print(f"{path}  ({path.stat().st_size:,} bytes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bertpipe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run the workflow (or some stages); fresh stages are skipped")
    _add_config_args(p)
    stages = _stages_help()
    p.add_argument("--only", action="append", metavar="STAGE[,STAGE...]",
                   help=f"run just these stages (repeatable); stages: {stages}")
    p.add_argument("--from", dest="start", metavar="STAGE",
                   help=f"run this stage and the later ones (opt-in ones only when named); stages: {stages}")
    p.add_argument("--force", action="store_true", help="rerun the selected stages even if fresh")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show Ray's, Ray Data's and the workers' own output too")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="state of every stage: fresh / stale / broken / missing")
    _add_config_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--verify", action="store_true",
                   help="also compare every committed file's sha256 with its manifest (reads every output)")
    p.add_argument("--check", action="store_true", help=STATUS_CHECK_HELP)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("config", help="print the resolved config (YAML, paths absolute) that `run` would use")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("fetch-sample", help="fetch the real Wikipedia sample dumps (gensim 4.4.0 wheel, via pip)")
    p.add_argument("--dest", default="data/sample")
    p.set_defaults(func=cmd_fetch_sample)

    from bertpipe.jobs.glue import predict as glue_predict

    glue_predict.add_parser(sub)

    try:
        from bertpipe.jobs import submit
        submit.add_parsers(sub, build_parser)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    # Credentials in URIs or NAME=value pairs are masked in every log record and in a traceback Python prints.
    redact.install_log_masking()
    redact.install_excepthook()
    # SIGINT / SIGTERM / SIGHUP end the run through an exception, so every cleanup runs (exit 128 + signal).
    interrupts.install()
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" when Python exits
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe or socket: an error like any other
            print(f"bertpipe: error: {redact.mask(_first_line(exc))}", file=sys.stderr)
            return 1
        # `bertpipe status --json | head -1`: the reader has what it wanted. End as a unix tool killed by SIGPIPE
        # would (141), quietly; what is still buffered goes to /dev/null rather than into an error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _SIGPIPE_EXIT


_SIGPIPE_EXIT = 128 + 13


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no fileno (replaced stdout), or no poll on this platform
        return False


def _dispatch(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # The console of this command, passed down from here (`bertpipe run` turns its progress on once it has begun).
    args.console = Console()
    _configure_logging(args.verbose, args.console)
    try:
        return args.func(args)
    except (ConfigError, StageInputError, ValueError, WorkdirBusy) as exc:
        print(f"bertpipe: error: {redact.mask(_with_config(_first_line(exc), args))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # before the run had a log file (preflight, the lock): one line
        print(f"bertpipe: {interrupts.interrupt_text(exc)}", file=sys.stderr)
        return interrupts.exit_code(exc)
    except BrokenPipeError:
        raise  # main: a closed stdout ends quietly
    except OSError as exc:  # before the run had a log file: a full disk refusing the lock record, say
        print(f"bertpipe: error: {redact.mask(_first_line(exc))}", file=sys.stderr)
        return 1


def _configure_logging(verbose: bool, console: Console) -> None:
    """Console: warnings (everything with --verbose); the run's log file gets everything (see _log_file)."""
    # MLflow writes "View run ... at: <tracking URI>" straight to stdout, user:password included: never.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if not verbose:
        # Read when MLflow and Ray Data set up their own loggers (they install handlers of their own).
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.DEBUG if verbose else logging.WARNING)
    handler.addFilter(console.log_filter)  # quiet while a failed run cleans up: it ends with three lines
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    for name in ("alembic", "mlflow", "urllib3", "filelock", "fsspec"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


def _first_line(exc: BaseException) -> str:
    """One line for the console (Ray and pyarrow append advice and tracebacks to their messages)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())

"""`bertpipe submit` and `bertpipe jobs`: the workflow (or any subcommand) as a Ray job, through the Jobs API.

Authentication is Ray's token auth: with RAY_AUTH_MODE=token the Jobs client sends the token from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. A cluster that refuses it is one line (exit 2) that says
where the token is read from. The job inherits MLFLOW_TRACKING_URI so the driver on the cluster logs where the
submitter looks.

`submit` behaves as `ray job submit`: it follows the job's logs through the Jobs API's log stream
(JobSubmissionClient.tail_job_logs) until the job ends and exits with the job's outcome; `--no-wait` returns once
the job is submitted, printing the commands that follow it. `--submission-id` (alias `--job-id`),
`--runtime-env-json`, `--working-dir` and `--entrypoint-num-cpus/gpus` mean what they mean to `ray job submit`.
Before anything is submitted the command after `--` is parsed and its config (preset or file, every `--set`) is
checked here: a typo is the same one line (exit 2) that `bertpipe run` gives, not a job that fails on the cluster.

`--working-dir DIR` whose DIR holds bertpipe's own code (a checkout: jobs/, pipeline/, model/) runs that code on
the cluster, not the package installed in the image: the installed package maps `bertpipe.jobs` to jobs/ etc.
(pyproject's package-dir), so nothing in an uploaded working dir is importable as `bertpipe`. The code is staged
as a `bertpipe` package (with the checkout's configs/) and sent as a runtime_env `py_modules` entry, which Ray
puts on the PYTHONPATH of the job's driver and of every worker, ahead of site-packages.

No secret travels with a job: a job's runtime_env is readable by anyone who can reach the Jobs API and is
written into the job's logs, so `--env` refuses secret-looking names and values with credentials, and the
forwarded tracking URI loses its user:password@ part. The cluster gives jobs their secrets (README, "Secrets").
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bertpipe.pipeline.framework.redact import has_credentials, is_secret_name, mask, strip_userinfo

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "AWS_REGION", "AWS_DEFAULT_REGION")
SECRETS_HOWTO = ("give it from the cluster instead: a Kubernetes Secret in the Ray pods' env (secretKeyRef), or the "
                 "Ray head's own environment, which every job inherits (README: Secrets for a submitted job)")


class SecretInEnv(ValueError):
    """A secret would be stored in the job's runtime_env: a user error with a one-line fix."""


def job_env(environ: dict[str, str], items: list[str]) -> tuple[dict[str, str], list[str]]:
    """The job's env vars (what the submitter forwards + `--env KEY=VALUE`) and notes on what was held back.
    SecretInEnv for an `--env` whose name looks like a secret or whose value carries credentials."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    notes = []
    for key in FORWARDED_ENV:
        value = environ.get(key)
        if value and has_credentials(value):
            value = strip_userinfo(value)
            notes.append(f"{key} is forwarded without its credentials ({mask(environ[key])} -> {value}); the "
                         "job's driver authenticates with MLFLOW_TRACKING_USERNAME/PASSWORD from the cluster")
        if value:
            env[key] = value
    held = [k for k in environ if k.startswith("MLFLOW_TRACKING_") and is_secret_name(k)]
    if held:
        notes.append(f"{', '.join(sorted(held))} not forwarded to the job (a job's env is readable through the Jobs "
                     "API); " + SECRETS_HOWTO)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r}: expected KEY=VALUE")
        if is_secret_name(key) or has_credentials(value):
            raise SecretInEnv(f"--env {key}: refused, a secret passed this way is stored in the job's runtime_env, "
                              f"readable through the Jobs API and written to the job's logs; {SECRETS_HOWTO}")
        env[key] = value
    return env, notes


def _address(args) -> str:
    return args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") \
        or DEFAULT_DASHBOARD


class ClusterUnreachable(ValueError):
    """No Ray cluster answers at the address: a user error with a one-line fix, not a traceback."""


class ClusterRefusedToken(ValueError):
    """The cluster's Jobs API answered 401 (no token sent) or 403 (a token it does not accept)."""


TOKEN_SOURCES = "RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token"


def _token_source() -> str:
    """Where Ray's client takes the token from, in Ray's order of precedence (never the token itself)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"the file {os.environ['RAY_AUTH_TOKEN_PATH']} (RAY_AUTH_TOKEN_PATH)"  # not NAME=value: masked
    default = Path.home() / ".ray" / "auth_token"
    return f"the file {default}" if default.is_file() else ""


def _check_token_file() -> None:
    """A RAY_AUTH_TOKEN_PATH that cannot be read: Ray treats it as fatal (it aborts); one line here instead."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not path or os.environ.get("RAY_AUTH_TOKEN"):
        return
    try:
        empty = not Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ClusterRefusedToken(f"cannot read the Ray token file {path} that RAY_AUTH_TOKEN_PATH names "
                                  f"({exc.strerror}): point it at the cluster's token file, or set RAY_AUTH_TOKEN"
                                  ) from None
    if empty:
        raise ClusterRefusedToken(f"the Ray token file {path} that RAY_AUTH_TOKEN_PATH names is empty: it must hold "
                                  "the cluster's token")


@contextlib.contextmanager
def _refusal_in_one_line(address: str):
    """Ray's AuthenticationError (a multi-line message, a traceback if uncaught) as one line naming where the token
    is read from."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as exc:
        sent = _token_source()
        why = ("no token was sent" if not sent or "required" in str(exc).lower().split(":")[0]
               else f"it does not accept the token from {sent}")
        raise ClusterRefusedToken(
            f"the Ray cluster at {address} refused authentication ({why}); bertpipe sends the token from "
            f"{TOKEN_SOURCES} (set it to the cluster's token)") from None


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    _check_token_file()
    if os.environ.get("RAY_AUTH_MODE") != "token" and _token_source():
        # A token is at hand but auth mode is unset: the client would send nothing and get a 401.
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        with _refusal_in_one_line(address):
            return JobSubmissionClient(address)
    except ConnectionError:
        raise ClusterUnreachable(
            f"no Ray cluster answers at {address}: start one with `infra/local/cluster.sh start` (then "
            "`source .bertpipe-local/env.sh`), or pass --address / set RAY_ADDRESS to your cluster's dashboard URL"
        ) from None


def _entrypoint(argv: list[str]) -> str:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ValueError("nothing to submit: give a bertpipe subcommand after --, e.g. `bertpipe submit -- run`")
    if argv[0] == "submit":
        raise ValueError("a submitted job cannot submit again")
    entrypoint = "bertpipe " + shlex.join(argv)
    if has_credentials(entrypoint):  # the entrypoint is stored with the job, as readable as its runtime_env
        raise SecretInEnv(f"the command {mask(entrypoint)!r} carries a credential; {SECRETS_HOWTO}")
    return entrypoint


def check_locally(argv: list[str], build_parser, working_dir: str = "") -> None:
    """The command after `--`, parsed and its config loaded here, before anything is submitted: argparse's own
    error (exit 2) for a bad option, ConfigError / ValueError (one line, exit 2) for a bad preset, file or `--set`,
    ValueError for an unknown stage. A relative `--config` file is looked up in `working_dir` when one is uploaded
    (the job runs there). Inputs on the cluster's disks are not checked here: the job's preflight does that."""
    from bertpipe.jobs.config import load_config

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # `submit -- --version` / `--help`: the job answers
            args = build_parser().parse_args(argv)
    except SystemExit as done:
        if done.code == 0:
            return
        raise
    if not hasattr(args, "overrides"):
        return
    where = working_dir if working_dir and os.path.isdir(working_dir) else os.getcwd()
    with contextlib.chdir(where):
        load_config(args.config, args.overrides, args.workdir)
    if getattr(args, "only", None) or getattr(args, "start", None):
        from bertpipe.jobs import workflow

        workflow.select([s for part in (args.only or []) for s in part.split(",") if s] or None, args.start)


CODE_DIRS = ("jobs", "pipeline", "model")


def holds_bertpipe_code(folder: str) -> bool:
    """Whether `folder` is a bertpipe checkout (its jobs/cli.py, pipeline/ and model/)."""
    return bool(folder) and os.path.isfile(os.path.join(folder, "jobs", "cli.py")) and all(
        os.path.isdir(os.path.join(folder, d)) for d in CODE_DIRS)


def stage_code(folder: str, into: str) -> str:
    """The checkout's code as an importable `bertpipe` package under `into` (jobs/, pipeline/, model/ and
    configs/, caches left out); returns the package's folder, for runtime_env py_modules."""
    package = os.path.join(into, "bertpipe")
    os.makedirs(package)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write('"""bertpipe, from the working dir of a submitted job (bertpipe submit --working-dir)."""\n')
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in (*CODE_DIRS, "configs"):
        if os.path.isdir(os.path.join(folder, name)):
            shutil.copytree(os.path.join(folder, name), os.path.join(package, name), ignore=skip)
    return package


def runtime_env_for(args, environ: dict[str, str]) -> tuple[dict, list[str]]:
    """The job's runtime_env: `--runtime-env-json` (a JSON object, as `ray job submit` takes it), its env_vars
    checked as `--env` is (no secrets) and merged under the forwarded ones and `--env`; `--working-dir` replaces
    its working_dir. Returns (runtime_env, notes)."""
    runtime_env: dict = {}
    if args.runtime_env_json:
        try:
            runtime_env = json.loads(args.runtime_env_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--runtime-env-json: not JSON ({exc})") from None
        if not isinstance(runtime_env, dict):
            raise ValueError("--runtime-env-json: expected a JSON object, e.g. '{\"pip\": [\"emoji\"]}'")
    given = runtime_env.get("env_vars") or {}
    if not isinstance(given, dict):
        raise ValueError("--runtime-env-json: env_vars must be an object of KEY: VALUE strings")
    env, notes = job_env(environ, [f"{k}={v}" for k, v in given.items()] + list(args.env))
    runtime_env["env_vars"] = env
    if args.working_dir:
        runtime_env["working_dir"] = args.working_dir
    return runtime_env, notes


def cmd_submit(args) -> int:
    address = _address(args)
    entrypoint = _entrypoint(args.argv)
    runtime_env, notes = runtime_env_for(args, dict(os.environ))  # refuses a secret before anything is sent
    working_dir = runtime_env.get("working_dir", "")
    if isinstance(working_dir, str) and working_dir and not storage_uri(working_dir) \
            and not os.path.isdir(working_dir):
        raise ValueError(f"--working-dir {working_dir}: no such folder")
    check_locally(shlex.split(entrypoint)[1:], args.build_parser,
                  working_dir if isinstance(working_dir, str) else "")
    for note in notes:
        print(f"bertpipe: note: {note}", file=sys.stderr)
    client = _client(address)
    resources = {k: v for k, v in (("entrypoint_num_cpus", args.entrypoint_num_cpus),
                                   ("entrypoint_num_gpus", args.entrypoint_num_gpus)) if v is not None}
    with tempfile.TemporaryDirectory(prefix="bertpipe-code-") as staging:
        if isinstance(working_dir, str) and holds_bertpipe_code(working_dir):
            runtime_env["py_modules"] = [*runtime_env.get("py_modules", []), stage_code(working_dir, staging)]
        submitted = time.time()
        with _refusal_in_one_line(address):
            try:
                job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                           submission_id=args.submission_id or None, **resources)
            except RuntimeError as exc:  # the cluster refused the job (an id taken, a runtime_env it rejects)
                raise ValueError(f"the cluster refused the job: {_refusal(exc)}") from None
    env = runtime_env["env_vars"]
    print(f"job:       {job_id}")
    print(f"entry:     {mask(entrypoint)}")
    if "py_modules" in runtime_env and isinstance(working_dir, str) and holds_bertpipe_code(working_dir):
        print(f"code:      bertpipe from {working_dir} (uploaded; not the cluster's installed package)")
    print(f"dashboard: {address.rstrip('/')}/#/jobs/{job_id}")
    print(f"mlflow:    {env.get('MLFLOW_TRACKING_URI', '(the config default: a SQLite store under the workdir)')}")
    if args.no_wait:
        for what, action in (("follow", "logs --follow"), ("status", "status"), ("stop", "stop")):
            print(f"{what + ':':<10} {_jobs_command(args, action, job_id)}")
        sys.stdout.flush()
        return 0
    print("[bertpipe] following the job's logs until it ends (Ctrl-C stops following, not the job; "
          "--no-wait returns at once)", flush=True)
    with _refusal_in_one_line(address):
        return _follow(client, job_id, submitted, args)


def _refusal(exc: Exception) -> str:
    """The line of Ray's "Request failed with status code 400: ..." that says why (its message is multi-line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # Ray's text holds a server-side traceback: its source lines (`raise RuntimeError(...)`) are no reason
    why = next((line for line in lines if "already exists" in line), None) or next(
        (line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)), lines[0] if lines else "")
    return mask(why)


def storage_uri(path: str) -> bool:
    """A working_dir Ray fetches itself (s3://, gs://, https://...zip), not a local folder."""
    return "://" in path


def _jobs_command(args, action: str, job_id: str) -> str:
    """`bertpipe jobs ACTION JOB`, with the user's --address when they gave one."""
    return shlex.join(["bertpipe", "jobs", *action.split(), job_id, *(["--address", args.address] if args.address
                                                                       else [])])


def exit_status(info) -> int:
    """The exit status of a job that ended: 0 if it succeeded, else its driver's own exit status when Ray
    knows it (2: bad input, 130/143: interrupted), else 1."""
    status = str(info.status).split(".")[-1]
    if status == "SUCCEEDED":
        return 0
    code = getattr(info, "driver_exit_code", None)
    return code if isinstance(code, int) and 0 < code < 256 else 1


def _follow(client, job_id: str, submitted: float, args) -> int:
    """The job's logs as Ray streams them (JobSubmissionClient.tail_job_logs: a websocket that sends each chunk
    as the driver writes it and closes when the job ends), then its final state; the exit status of the job."""
    try:
        asyncio.run(_tail(client, job_id, submitted))
        info = client.get_job_info(job_id)
        status = str(info.status).split(".")[-1]
        why = f": {info.message.strip().splitlines()[0]}" if status != "SUCCEEDED" and info.message else ""
        print(f"[bertpipe] job {job_id} {status} after {time.time() - submitted:.1f} s{why}", flush=True)
        return exit_status(info)
    except KeyboardInterrupt as exc:  # the job goes on: say how to find it again
        from bertpipe.jobs.services import interrupts

        print(f"bertpipe: stopped following job {job_id} ({interrupts.interrupt_text(exc)}); it goes on: "
              f"{_jobs_command(args, 'logs --follow', job_id)}, or stop it: {_jobs_command(args, 'stop', job_id)}",
              file=sys.stderr)
        return interrupts.exit_code(exc)


async def _tail(client, job_id: str, submitted: float) -> None:
    """Print the log stream until it ends; meanwhile one line when the job starts running (its state is asked
    once a second until then, in a thread: the client is synchronous)."""
    async def announce_running() -> None:
        while True:
            status = str(await asyncio.to_thread(client.get_job_status, job_id)).split(".")[-1]
            if status == "RUNNING" or status in TERMINAL:
                if status == "RUNNING":
                    print(f"[bertpipe] job running {time.time() - submitted:.1f} s after submission", flush=True)
                return
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(announce_running())
    try:
        async for chunk in client.tail_job_logs(job_id):
            if not watcher.done():  # the job's output only after the line that says it runs
                await asyncio.wait({watcher}, timeout=5)
            sys.stdout.write(chunk)
            sys.stdout.flush()
    finally:
        if not watcher.done():
            watcher.cancel()


JOB_STATUS_EXIT = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 4, "PENDING": 3, "RUNNING": 3}
JOB_STATUS_CODES = ("exit status: 0 SUCCEEDED, 1 FAILED, 3 PENDING or RUNNING (not ended yet), 4 STOPPED, "
                    "2 an error here (no such job, no cluster, a refused token)")


def cmd_jobs(args) -> int:
    address = _address(args)
    client = _client(address)
    with _refusal_in_one_line(address):
        return _jobs_action(client, args)


def _job_info(client, job: str):
    """The job's JobDetails; a job the cluster does not know is one line (exit 2), not Ray's RuntimeError."""
    try:
        return client.get_job_info(job)
    except RuntimeError as exc:
        if "does not exist" in str(exc) or "404" in str(exc):
            raise ValueError(f"no job {job!r} on this cluster (`bertpipe jobs list` lists them)") from None
        raise


def _jobs_action(client, args) -> int:
    if args.action == "status":
        info = _job_info(client, args.job)
        status = str(info.status).split(".")[-1]
        print(f"{args.job}: {status}" + (f" ({info.message})" if info.message else ""))
        return JOB_STATUS_EXIT.get(status, 1)
    elif args.action == "logs":
        if args.follow:
            _job_info(client, args.job)
            return _follow(client, args.job, time.time(), args)
        sys.stdout.write(client.get_job_logs(args.job))
    elif args.action == "stop":
        stopped = client.stop_job(args.job)
        print(f"{args.job}: {'stop requested' if stopped else 'already finished'}")
    elif args.action == "list":
        for job in client.list_jobs():
            print(f"{job.submission_id or job.job_id}  {str(job.status).split('.')[-1]:<9}  {mask(job.entrypoint)}")
    return 0


ADDRESS_HELP = (f"the cluster's dashboard URL (default: $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else "
                f"{DEFAULT_DASHBOARD})")


def add_parsers(sub, build_parser) -> None:
    """The submit and jobs subcommands; `build_parser` makes the CLI's own parser, which `submit` uses to check the
    command after `--` locally (passed in: this module is below the CLI, never importing it)."""
    p = sub.add_parser("submit", help="submit a bertpipe subcommand to a Ray cluster as a job and follow its logs",
                       usage="bertpipe submit [--address URL] [--no-wait] [--working-dir DIR] [--runtime-env-json "
                             "JSON] [--submission-id ID] -- run [run options]")
    p.add_argument("--address", default="", help=ADDRESS_HELP)
    p.add_argument("--no-wait", action="store_true",
                   help="return once the job is submitted, printing the commands that follow it (default, as "
                        "`ray job submit`: follow the job's logs until it ends and exit with its outcome: 0 if it "
                        "succeeded, else its exit status, or 1)")
    p.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("--working-dir", default="",
                   help="upload this folder as the job's working dir (the job runs in it); a bertpipe checkout's "
                        "code (jobs/, pipeline/, model/, configs/) then runs instead of the installed package")
    p.add_argument("--runtime-env-json", default="", metavar="JSON",
                   help="the job's runtime_env as JSON, as `ray job submit` takes it (pip, py_modules, env_vars, "
                        "...); --working-dir and --env override its fields")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env var for the job")
    p.add_argument("--submission-id", "--job-id", dest="submission_id", default="", metavar="ID",
                   help="the job's submission id (default: generated); --job-id is the old spelling")
    p.add_argument("--entrypoint-num-cpus", type=float, default=None, metavar="N",
                   help="CPUs reserved for the job's driver (as `ray job submit`; default: none)")
    p.add_argument("--entrypoint-num-gpus", type=float, default=None, metavar="N",
                   help="GPUs reserved for the job's driver (as `ray job submit`; default: none)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the bertpipe subcommand to run")
    p.set_defaults(func=cmd_submit, build_parser=build_parser)

    p = sub.add_parser("jobs", help="status, logs, stop or list of submitted jobs",
                       epilog=f"`jobs status` {JOB_STATUS_CODES}")
    p.add_argument("--address", default="", help=ADDRESS_HELP)
    p.set_defaults(func=cmd_jobs, job="", follow=False)
    actions = p.add_subparsers(dest="action", required=True, metavar="{status,logs,stop,list}")
    # One parser per action, so that options and the job id go in any order (`logs --follow JOB`, `logs JOB
    # --follow`); --address here too, after the action, as `ray job` takes it.
    for action, what in (("status", f"the job's state; {JOB_STATUS_CODES}"), ("logs", "the job's logs so far"),
                         ("stop", "ask the cluster to stop the job"), ("list", "every job the cluster knows")):
        a = actions.add_parser(action, help=what, description=what)
        if action != "list":
            a.add_argument("job", metavar="JOB_ID", help="the submission id `submit` printed (`jobs list` lists them)")
        if action == "logs":
            a.add_argument("--follow", action="store_true", help="follow the logs until the job ends")
        a.add_argument("--address", default=argparse.SUPPRESS, help=ADDRESS_HELP)

"""`bertpipe submit` and `bertpipe jobs`: the workflow (or any subcommand) as a Ray job, through the Jobs API.

Authentication is Ray's token auth: with RAY_AUTH_MODE=token the Jobs client sends the token from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. A cluster that refuses it is one line (exit 2) that says
where the token is read from. The job inherits MLFLOW_TRACKING_URI so the driver on the cluster logs where the
submitter looks.

`submit` behaves as `ray job submit`: it follows the job's logs until the job ends and exits with the job's
outcome; `--no-wait` returns once the job is submitted, printing the commands that follow it.

No secret travels with a job: a job's runtime_env is readable by anyone who can reach the Jobs API and is
written into the job's logs, so `--env` refuses secret-looking names and values with credentials, and the
forwarded tracking URI loses its user:password@ part. The cluster gives jobs their secrets (README, "Secrets").
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from pathlib import Path

from bertpipe.pipeline.redact import has_credentials, is_secret_name, mask, strip_userinfo

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


def cmd_submit(args) -> int:
    address = _address(args)
    entrypoint = _entrypoint(args.argv)
    env, notes = job_env(dict(os.environ), args.env)  # refuses a secret before anything reaches the cluster
    for note in notes:
        print(f"bertpipe: note: {note}", file=sys.stderr)
    runtime_env: dict = {"env_vars": env}
    if args.working_dir:
        runtime_env["working_dir"] = args.working_dir
    client = _client(address)
    submitted = time.time()
    with _refusal_in_one_line(address):
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                   submission_id=args.job_id or None)
    print(f"job:       {job_id}")
    print(f"entry:     {mask(entrypoint)}")
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
    printed, first_running = 0, None
    try:
        while True:
            status = str(client.get_job_status(job_id)).split(".")[-1]
            if status == "RUNNING" and first_running is None:
                first_running = time.time()
                print(f"[bertpipe] job running {first_running - submitted:.1f} s after submission", flush=True)
            logs = client.get_job_logs(job_id)
            if len(logs) > printed:
                sys.stdout.write(logs[printed:])
                sys.stdout.flush()
                printed = len(logs)
            if status in TERMINAL:
                info = client.get_job_info(job_id)
                why = f": {info.message.strip().splitlines()[0]}" if status != "SUCCEEDED" and info.message else ""
                print(f"[bertpipe] job {job_id} {status} after {time.time() - submitted:.1f} s{why}", flush=True)
                return exit_status(info)
            time.sleep(1.0)
    except KeyboardInterrupt as exc:  # the job goes on: say how to find it again
        from bertpipe.jobs import interrupts

        print(f"bertpipe: stopped following job {job_id} ({interrupts.describe(exc)}); it goes on: "
              f"{_jobs_command(args, 'logs --follow', job_id)}, or stop it: {_jobs_command(args, 'stop', job_id)}",
              file=sys.stderr)
        return interrupts.exit_code(exc)


def cmd_jobs(args) -> int:
    address = _address(args)
    client = _client(address)
    with _refusal_in_one_line(address):
        return _jobs_action(client, args)


def _jobs_action(client, args) -> int:
    if args.action == "status":
        info = client.get_job_info(args.job)
        print(f"{args.job}: {str(info.status).split('.')[-1]}" + (f" ({info.message})" if info.message else ""))
    elif args.action == "logs":
        if args.follow:
            return _follow(client, args.job, time.time(), args)
        sys.stdout.write(client.get_job_logs(args.job))
    elif args.action == "stop":
        stopped = client.stop_job(args.job)
        print(f"{args.job}: {'stop requested' if stopped else 'already finished'}")
    elif args.action == "list":
        for job in client.list_jobs():
            print(f"{job.submission_id or job.job_id}  {str(job.status).split('.')[-1]:<9}  {mask(job.entrypoint)}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("submit", help="submit a bertpipe subcommand to a Ray cluster as a job and follow its logs",
                       usage="bertpipe submit [--address URL] [--no-wait] -- run [run options]")
    p.add_argument("--address", default="", help=f"dashboard URL (default: $RAY_ADDRESS or {DEFAULT_DASHBOARD})")
    p.add_argument("--no-wait", action="store_true",
                   help="return once the job is submitted, printing the commands that follow it (default, as "
                        "`ray job submit`: follow the job's logs until it ends and exit with its outcome: 0 if it "
                        "succeeded, else its exit status, or 1)")
    p.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("--working-dir", default="",
                   help="upload this folder as the job's working dir (code not in the image)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env var for the job")
    p.add_argument("--job-id", default="", help="submission id (default: generated)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the bertpipe subcommand to run")
    p.set_defaults(func=cmd_submit)

    address_help = f"dashboard URL (default: $RAY_ADDRESS or {DEFAULT_DASHBOARD})"
    p = sub.add_parser("jobs", help="status, logs, stop or list of submitted jobs")
    p.add_argument("--address", default="", help=address_help)
    p.set_defaults(func=cmd_jobs, job="", follow=False)
    actions = p.add_subparsers(dest="action", required=True, metavar="{status,logs,stop,list}")
    # One parser per action, so that options and the job id go in any order (`logs --follow JOB`, `logs JOB
    # --follow`); --address here too, after the action, as `ray job` takes it.
    for action, what in (("status", "the job's state"), ("logs", "the job's logs so far"),
                         ("stop", "ask the cluster to stop the job"), ("list", "every job the cluster knows")):
        a = actions.add_parser(action, help=what)
        if action != "list":
            a.add_argument("job", metavar="JOB_ID", help="the submission id `submit` printed (`jobs list` lists them)")
        if action == "logs":
            a.add_argument("--follow", action="store_true", help="follow the logs until the job ends")
        a.add_argument("--address", default=argparse.SUPPRESS, help=address_help)

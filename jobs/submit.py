"""`bertpipe submit` and `bertpipe jobs`: the workflow (or any subcommand) as a Ray job, through the Jobs API.

Authentication is Ray's token auth: with RAY_AUTH_MODE=token the Jobs client sends the token from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. The job inherits MLFLOW_TRACKING_URI so the
driver on the cluster logs where the submitter looks.

No secret travels with a job: a job's runtime_env is readable by anyone who can reach the Jobs API and is
written into the job's logs, so `--env` refuses secret-looking names and values with credentials, and the
forwarded tracking URI loses its user:password@ part. The cluster gives jobs their secrets (README, "Secrets").
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

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


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    has_token = (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                 or os.path.exists(os.path.expanduser("~/.ray/auth_token")))
    if os.environ.get("RAY_AUTH_MODE") != "token" and has_token:
        # A token is at hand but auth mode is unset: the client would send nothing and get a 401.
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
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
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=args.job_id or None)
    print(f"job:       {job_id}")
    print(f"entry:     {mask(entrypoint)}")
    print(f"dashboard: {address.rstrip('/')}/#/jobs/{job_id}")
    print(f"mlflow:    {env.get('MLFLOW_TRACKING_URI', '(the config default: a SQLite store under the workdir)')}")
    sys.stdout.flush()
    if not args.wait:
        return 0
    return _follow(client, job_id, submitted)


def _follow(client, job_id: str, submitted: float) -> int:
    printed, first_running = 0, None
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
            print(f"[bertpipe] job {job_id} {status} after {time.time() - submitted:.1f} s", flush=True)
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(1.0)


def cmd_jobs(args) -> int:
    client = _client(_address(args))
    if args.action == "status":
        info = client.get_job_info(args.job)
        print(f"{args.job}: {str(info.status).split('.')[-1]}" + (f" ({info.message})" if info.message else ""))
    elif args.action == "logs":
        if args.follow:
            return _follow(client, args.job, time.time())
        sys.stdout.write(client.get_job_logs(args.job))
    elif args.action == "stop":
        stopped = client.stop_job(args.job)
        print(f"{args.job}: {'stop requested' if stopped else 'already finished'}")
    elif args.action == "list":
        for job in client.list_jobs():
            print(f"{job.submission_id or job.job_id}  {str(job.status).split('.')[-1]:<9}  {mask(job.entrypoint)}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("submit", help="submit a bertpipe subcommand to a Ray cluster as a job",
                       usage="bertpipe submit [--address URL] [--wait] -- run [run options]")
    p.add_argument("--address", default="", help=f"dashboard URL (default: $RAY_ADDRESS or {DEFAULT_DASHBOARD})")
    p.add_argument("--wait", action="store_true", help="follow the job's logs until it ends; exit 1 unless it succeeded")
    p.add_argument("--working-dir", default="", help="upload this folder as the job's working dir (code not in the image)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env var for the job")
    p.add_argument("--job-id", default="", help="submission id (default: generated)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the bertpipe subcommand to run")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="status, logs, stop or list of submitted jobs")
    p.add_argument("action", choices=["status", "logs", "stop", "list"])
    p.add_argument("job", nargs="?", default="")
    p.add_argument("--address", default="")
    p.add_argument("--follow", action="store_true", help="with logs: follow until the job ends")
    p.set_defaults(func=cmd_jobs)

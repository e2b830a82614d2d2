"""MLflow, all of it: the only module of the project that calls MLflow.

Everything goes through an explicit `MlflowClient(tracking_uri)`, never the fluent global state, so the same
coordinates ({tracking_uri, experiment_id, run_id}) can be handed to Ray tasks and Train workers, which log into
their run themselves with a `RunLogger`. A workflow run is one parent run, one nested run per stage; fine-tuning
nests a run per GLUE task and one per trial below its stage run.

Metric names follow one convention (below, `EVAL` ... `SYSTEM`), made for how MLflow's UI draws a run: it groups
the charts by the part of the name before the last "/", sections in alphabetical order, then the names without a
"/" (its "Model metrics"), "system/" in a tab of its own; charts within a section in alphabetical order too. A
metric whose last step is 0 is drawn as a bar (one value), one logged at steps >= 1 as a line over the steps.
"""
from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Callable

from bertpipe.jobs.services.causes import first_line, from_ray, strip_ansi
from bertpipe.jobs.services.configtools import to_dict
from bertpipe.jobs.services.metric_sender import MetricSender
from bertpipe.pipeline.framework.redact import mask, mask_data

MAX_PARAM_CHARS = 6000  # MLflow's limit for one param value
PARAM_BATCH, METRIC_BATCH = 100, 1000  # MLflow's log_batch limits
SERVER_CHECK_TIMEOUT_S = 5.0  # `check_server`: a tracking server that has not answered by then is not usable
# The metric sender of a training worker (RunLogger(..., background=True)): its defaults (the settings
# mlflow.buffer_points and mlflow.flush_timeout_s reach it in the run's coordinates), and how long one of its requests
# may go unanswered before it counts as a failure and is retried (a hung server is then as good as a stopped one).
BUFFER_POINTS, FLUSH_TIMEOUT_S, SENDER_REQUEST_TIMEOUT_S = 100_000, 120.0, 20.0
LOG_BATCH_ENDPOINT = "/api/2.0/mlflow/runs/log-batch"  # MLflow's REST API: the sender's one request
log = logging.getLogger(__name__)

# The metric-name convention. Series (logged at steps >= 1, lines):
EVAL = "eval/"                    # held-out figures, first section: eval/mlm_accuracy, eval/nsp_accuracy, eval/mlm_loss
TRAIN = "train/"                  # a logging window's training figures: train/loss (its section's first chart), ...
OPTIMIZER = "train/optimizer/"    # train/optimizer/lr, train/optimizer/grad_norm
THROUGHPUT = "train/throughput/"  # speed and feeding, steady windows only (no compile, start-up or phase switch)
SYSTEM = "system/"                # CPU, memory, GPU: MLflow's own system-metrics monitor
# Per event, at its step (names benchmarks/bench_chaos.py reads; MLflow's UI sorts both sections before train/):
RESTART = "restart/"              # where a restarted attempt's seconds went, at its first new step (metrics/restart.py)
CHECKPOINT = "checkpoint/"        # per checkpoint: checkpoint/stall_s (training blocked), checkpoint/upload_s
# Summary figures (one value per run) carry no prefix and are logged at step 0: bars, after the series.
# Accuracies, fractions and scores are fractions in [0, 1] everywhere, never percent.
OPTIMIZER_FIGURES = ("lr", "grad_norm")
THROUGHPUT_FIGURES = ("sequences_per_second", "tokens_per_second", "examples_per_second", "data_wait_fraction",
                      "padding_fraction", "model_tflops_per_second", "model_flops_utilization")
# What the UI shows for the experiment (its description: the tag `mlflow.note.content`, Markdown).


def unwrap(markdown: str) -> str:
    """Markdown written wrapped at 120 columns, as MLflow's UI must get it: one line per paragraph and list item
    (its renderer breaks the line wherever the text does)."""
    blocks: list[str] = []
    for line in markdown.strip().splitlines():
        text = line.strip()
        if not text:
            blocks.append("")
        elif blocks and blocks[-1] and not text.startswith(("* ", "- ")):
            blocks[-1] += " " + text
        else:
            blocks.append(text)
    return "\n".join(blocks) + "\n"


EXPERIMENT_DESCRIPTION = unwrap("""
**bertpipe**: BERT pre-training on Wikipedia, then fine-tuning. One workflow run per `bertpipe run`.

* A **workflow run** (`<config> #<n> · <date time>`) runs clean → vocab → pairs → pretrain → glue (and on
  request squad, ner, features). Its tags name the config, the git commit and the outcome; its metrics are the
  headline figures to compare runs by (`pretrain/...`, `glue/...`).
* Below it one **stage run** per stage, named by the stage: params = the stage's config, its manifest as an
  artifact. Fine-tuning nests a run per task and per trial.
* Metric sections: `eval/` held-out figures, `train/` training figures per logging window, `train/optimizer/`,
  `train/throughput/` (steady windows only), `system/`; `checkpoint/` what each checkpoint stalled training and
  its upload took, `restart/` where each restart's seconds went; figures without a prefix are one value per run
  (bars).
  Accuracies and GLUE scores are fractions in [0, 1] (summary.md gives GLUE scores in percent).
* The pre-trained model is registered as `bertpipe-<config>`; the alias `newest` is its latest version.
""")
OUR_NOTE = "**bertpipe**"  # how the experiment description the project writes starts
EXPERIMENT_TAGS = {"mlflow.note.content": EXPERIMENT_DESCRIPTION,
                   # MLflow 3 asks what an experiment is for (GenAI or model training): this is model training.
                   "mlflow.experimentKind": "custom_model_development"}
MODEL_ALIAS = "newest"  # MLflow reserves "latest"
PARAM_DIGITS = 6  # significant digits of a float written as a param or tag


def metric_name(figure: str) -> str:
    """A training figure's MLflow name under the convention: eval_X → eval/X, lr and grad_norm →
    train/optimizer/..., speed and feeding figures → train/throughput/..., anything else → train/..."""
    if figure.startswith("eval_"):
        return EVAL + figure[len("eval_"):]
    if figure in OPTIMIZER_FIGURES:
        return OPTIMIZER + figure
    if figure in THROUGHPUT_FIGURES:
        return THROUGHPUT + figure
    return TRAIN + figure


def metric_names(figures: dict[str, Any]) -> dict[str, Any]:
    return {metric_name(k): v for k, v in figures.items()}


def param_text(value: Any) -> str:
    """A param or tag value as people read it: floats to PARAM_DIGITS significant digits (0.0637, not
    0.06369426751592357), anything else as str()."""
    if isinstance(value, float) and math.isfinite(value):
        return format(value, f".{PARAM_DIGITS}g")
    return str(value)


def _best_effort(call, *args) -> Any:
    """call(*args), or None when it raised (logged, with the traceback, into the run's log file only: the console
    is the failure's). Returns True for a call that returns None."""
    try:
        result = call(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the store says, the run's own error is the one to report
        log.info("mlflow: %s failed: %s", getattr(call, "__name__", call), mask(str(exc)), exc_info=True)
        return None
    return True if result is None else result


def _setting(coordinates: dict[str, str], key: str, default: float) -> float:
    try:
        return float(coordinates.get(key, default))
    except (TypeError, ValueError):
        return default


def metric_sender(client, coordinates: dict[str, str], tell: Callable[[str], None] | None = None,
                  **options: Any) -> MetricSender:
    """The MetricSender for the run at `coordinates` (its buffer sized by their buffer_points). Its requests, and
    only its, run without MLflow's retries: MLflow retries a refused connection for minutes (7 tries with backoff)
    and logs each retry as a urllib3 warning; the sender retries itself, with its own backoff, and stays quiet.
    `options` go to MetricSender (a test's clock and backoff)."""
    uri = coordinates["tracking_uri"]
    sender = MetricSender(_batch_delivery(client, uri, coordinates["run_id"]),
                          int(_setting(coordinates, "buffer_points", BUFFER_POINTS)), batch=METRIC_BATCH,
                          where=f"the tracking server {mask(uri)}" if uri.startswith(("http:", "https:"))
                          else f"the tracking store {mask(uri)}", tell=tell, final=_refused_for_good,
                          reason=_short_reason, attempt_limit_s=SENDER_REQUEST_TIMEOUT_S, **options)
    _QUIET_THREADS.threads.add(sender.thread_id)
    return sender


def _batch_delivery(client, tracking_uri: str, run_id: str) -> Callable[[list], None]:
    """deliver(points) for a MetricSender: one log_batch of (key, value, timestamp, step) points. To a tracking
    server, the REST request MlflowClient.log_batch makes, sent as check_server sends its own: no retries, a
    SENDER_REQUEST_TIMEOUT_S timeout (MlflowClient takes neither per call, only from environment variables that
    would change every other MLflow call of the process too). To a local store (SQLite, files), client.log_batch."""
    from mlflow.entities import Metric

    if not tracking_uri.startswith(("http://", "https://")):
        return lambda points: client.log_batch(run_id, metrics=[Metric(*p) for p in points])
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.proto_json_utils import message_to_json
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    def deliver(points: list) -> None:
        body = message_to_json(LogBatch(run_id=run_id, metrics=[Metric(*p).to_proto() for p in points]))
        response = http_request(get_default_host_creds(tracking_uri), LOG_BATCH_ENDPOINT, "POST", max_retries=0,
                                timeout=SENDER_REQUEST_TIMEOUT_S, json=json.loads(body))
        verify_rest_response(response, LOG_BATCH_ENDPOINT)

    return deliver


def _refused_for_good(exc: BaseException) -> bool:
    """The server answered and refused the batch (HTTP 4xx other than 408/429): sending it again cannot help.
    A refused connection, a timeout or a 5xx (a server restarting behind a proxy) is the server being away."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status not in (408, 429)


def _short_reason(exc: BaseException) -> str:
    """Why a delivery failed, in a few words (MLflow's message nests urllib3's, a URL and a repr or two deep)."""
    status = re.search(r"too many (\d{3}) error responses", str(exc))
    return f"HTTP {status.group(1)}" if status else _connection_problem(exc, SENDER_REQUEST_TIMEOUT_S)


class _FromThreads(logging.Filter):
    """Drops the records of the sender threads: their requests fail on purpose while a server is away, and the
    sender says so once in its own words (a urllib3 or MLflow retry message would be one more line per request)."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int | None] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread not in self.threads


_QUIET_THREADS = _FromThreads()
for _name in ("urllib3.connectionpool", "mlflow.utils.rest_utils", "mlflow.utils.request_utils"):
    logging.getLogger(_name).addFilter(_QUIET_THREADS)


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        text = json.dumps(data) if isinstance(data, (list, tuple)) else param_text(data)
        out[prefix[:-1]] = text[:MAX_PARAM_CHARS]
    return out


def _client(tracking_uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri)


class RunLogger:
    """One MLflow run, from plain coordinates. Inactive (every call a no-op) without a URI and run id, or when
    `enabled` is False (Train ranks other than 0).

    `background=True` (a training worker): `log_metrics` never waits for the tracking server. Its points go to a
    MetricSender (jobs/services/metric_sender.py): a buffer of `buffer_points` (from the coordinates) and a thread
    that delivers them, one request without MLflow's own retries at a time, retrying while the server is away;
    `tell(line)` shows its few lines (unreachable, back, what was lost) to the user. `flush_metrics()` ends it."""

    def __init__(self, coordinates: dict[str, str] | None, enabled: bool = True, background: bool = False,
                 tell: Callable[[str], None] | None = None):
        self.coordinates = dict(coordinates or {})
        self.run_id = self.coordinates.get("run_id", "")
        active = enabled and bool(self.coordinates.get("tracking_uri")) and bool(self.run_id)
        self.client = _client(self.coordinates["tracking_uri"]) if active else None
        self.sender: MetricSender | None = None
        if active and background:
            self.sender = metric_sender(self.client, self.coordinates, tell)

    @property
    def active(self) -> bool:
        return self.client is not None

    def child(self, run_name: str, tags: dict[str, str]) -> "RunLogger":
        """A nested run below this one (inactive if this one is)."""
        if not self.active:
            return RunLogger(None)
        run = self.client.create_run(self.coordinates["experiment_id"], run_name=run_name,
                                     tags={"mlflow.parentRunId": self.run_id, **mask_data(tags)})
        return RunLogger({**self.coordinates, "run_id": run.info.run_id, "parent_run_id": self.run_id})

    def log_params(self, params: dict[str, Any], skip_logged: bool = False) -> None:
        if not self.active:
            return
        from mlflow.entities import Param

        flat = mask_data(flatten(to_dict(params)))  # a tracking URI or input URI with a password: masked
        if skip_logged:  # MLflow refuses to change a logged param; the workflow may have logged some already
            logged = self.client.get_run(self.run_id).data.params
            flat = {k: v for k, v in flat.items() if k not in logged}
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + PARAM_BATCH])

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Finite numbers only (NaN/inf and non-numbers are dropped), at `step` (0 when None)."""
        if not self.active:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [(k, float(v), now, step or 0) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
        if self.sender is not None:
            self.sender.put(points)
            return
        items = [Metric(*p) for p in points]
        for i in range(0, len(items), METRIC_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + METRIC_BATCH])

    def flush_metrics(self, timeout_s: float | None = None) -> int:
        """The end of a background logger's metrics: waits up to `timeout_s` (default: the coordinates'
        flush_timeout_s) for the buffered points to reach the server; returns how many never did (a line said so).
        Later log_metrics calls go straight to the store. 0 for a logger without a sender."""
        sender, self.sender = self.sender, None
        if sender is None:
            return 0
        limit = _setting(self.coordinates, "flush_timeout_s", FLUSH_TIMEOUT_S) if timeout_s is None else timeout_s
        return sender.close(limit)

    def logged_metric_names(self) -> set[str]:
        return set(self.client.get_run(self.run_id).data.metrics) if self.active else set()

    def log_dict(self, data: Any, name: str) -> None:
        self.log_bytes(json.dumps(mask_data(to_dict(data)), indent=2, sort_keys=True).encode(), name)

    def log_bytes(self, blob: bytes, name: str, artifact_path: str | None = None) -> None:
        if not self.active:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(blob)
            self.client.log_artifact(self.run_id, path, artifact_path)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        if self.active:
            self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def log_export(self, export_dir: str, registered_name: str, hidden_size: int, description: str = "",
                   version_description: str = "", version_tags: dict[str, str] | None = None) -> str:
        """Log an export folder (safetensors + config.json + vocab.txt) as an MLflow model of this run — code
        (jobs/services/pyfunc_model.py) plus the folder, no pickle — and register it under `registered_name`: the
        registered model gets `description` (when it has none: a user's own is kept), the new version
        `version_description` and `version_tags`, and the alias MODEL_ALIAS moves to it. Returns the model URI
        ("" when inactive). The fluent API is the only way MLflow logs models: it is confined here, bound to this
        run and this tracking URI for the duration of the call."""
        if not self.active:
            return ""
        import mlflow
        import numpy as np
        import torch
        from mlflow.models import ModelSignature
        from mlflow.types import DataType
        from mlflow.types.schema import Array, ColSpec, Schema, TensorSpec

        # The loader's path without importing it: MLflow runs it while logging (its console chatter captured below).
        loader = importlib.util.find_spec("bertpipe.jobs.services.pyfunc_model").origin

        signature = ModelSignature(inputs=Schema([ColSpec(Array(DataType.long), "input_ids")]),
                                   outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, hidden_size))]))
        # set_tracking_uri also writes MLFLOW_TRACKING_URI into the environment (inherited by Ray workers
        # started later): put both back exactly as they were.
        previous, env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.coordinates["tracking_uri"])
        chatter = io.StringIO()  # MLflow prints "Successfully registered model ..." itself: keep it to the log file
        try:
            with mlflow.start_run(run_id=self.run_id), redirect_stdout(chatter), redirect_stderr(chatter):
                # Explicit requirements: inferring them imports and inspects the whole environment (slow).
                info = mlflow.pyfunc.log_model(
                    name="model", python_model=loader, artifacts={"export": export_dir},
                    registered_model_name=registered_name, signature=signature,
                    pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "transformers", "safetensors"])
        finally:
            logging.getLogger(__name__).info("mlflow: %s", chatter.getvalue().strip())
            mlflow.set_tracking_uri(previous)
            if env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env
        version = str(info.registered_model_version)
        if description and not self.client.get_registered_model(registered_name).description:
            self.client.update_registered_model(registered_name, description=description)
        if version_description:
            self.client.update_model_version(registered_name, version, description=version_description)
        for key, value in (version_tags or {}).items():
            self.client.set_model_version_tag(registered_name, version, key, mask(param_text(value)))
        self.client.set_registered_model_alias(registered_name, MODEL_ALIAS, version)
        return info.model_uri

    def tags(self) -> dict[str, str]:
        """This run's tags ({} when inactive)."""
        return dict(self.client.get_run(self.run_id).data.tags) if self.active else {}

    def parent_tags(self) -> dict[str, str]:
        """The tags of the run this one is nested in ({} when it is not nested, or inactive)."""
        parent = self.tags().get("mlflow.parentRunId")
        return dict(self.client.get_run(parent).data.tags) if parent else {}

    def system_metrics(self, interval_s: float = 5.0) -> "SystemMetrics | None":
        """A started monitor of CPU / memory / disk / network / GPU use logged into this run every `interval_s`
        (`.finish()` it), or None."""
        return SystemMetrics(self, interval_s) if self.active else None

    def fail(self, exc: BaseException, traceback_text: str) -> None:
        """Mark the run FAILED with the error as a tag and the traceback as an artifact. Best effort, each step on
        its own: this runs while a stage fails, maybe because the disk that holds the store is full, and must not
        replace the stage's error with its own."""
        # A Ray error's text is the remote traceback: the tag gets the root error the console printed (causes.py).
        cause = strip_ansi(first_line(exc) if from_ray(exc) else f"{type(exc).__name__}: {exc}")[:5000]
        _best_effort(self.set_tag, "bertpipe.error", cause)
        _best_effort(self.log_bytes, mask(strip_ansi(traceback_text)).encode(), "traceback.txt")
        _best_effort(self.end, False)

    def kill(self, reason: str) -> bool:
        """Mark the run KILLED (a signal stopped it), and every run below it still RUNNING. Best effort."""
        if not self.active:
            return True
        tagged = _best_effort(self.set_tag, "bertpipe.error", reason)
        killed = _best_effort(kill_run_tree, self.coordinates["tracking_uri"], self.run_id)
        return bool(tagged) and killed is not None

    def close(self, outcome: str, metrics: dict[str, float]) -> bool:
        """End a workflow run: its headline metrics, the tag bertpipe.status = outcome (succeeded / failed /
        killed), and the matching status (KILLED also for the runs below it that are still RUNNING). Best effort;
        True when all of it reached the store."""
        if not self.active:
            return True
        done = [_best_effort(self.log_metrics, metrics), _best_effort(self.set_tag, "bertpipe.status", outcome)]
        if outcome == "killed":
            done.append(_best_effort(kill_run_tree, self.coordinates["tracking_uri"], self.run_id) is not None)
        else:
            done.append(_best_effort(self.end, outcome == "succeeded"))
        return all(done)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.set_tag(key, value)

    def set_tag(self, key: str, value: str) -> None:
        if self.active:
            self.client.set_tag(self.run_id, key, mask(str(value)))

    def end(self, ok: bool) -> None:
        if self.active:
            self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class SystemMetrics:
    """This machine's use, sampled by MLflow's system-metrics monitor every `interval_s` and logged into `run` as
    `system/...` through a MetricSender. MLflow's own loop does not serve a run that outlives a tracking-server
    outage: it asks the server for the run's status before every sample, with MLflow's retries (a urllib3 warning
    each on the console), and stops for good at the first failure. Here only the sampling is MLflow's; the loop and
    the delivery are ours, and an outage is one line in the run's log."""

    def __init__(self, run: RunLogger, interval_s: float = 5.0):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.interval_s = interval_s
        self.sampler = SystemMetricsMonitor(run.run_id, sampling_interval=interval_s,
                                            tracking_uri=run.coordinates["tracking_uri"])
        self.sampler.mlflow_logger = self  # its publish_metrics() hands each aggregate to record_metrics below
        self.sender = metric_sender(run.client, run.coordinates)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bertpipe-system-metrics", daemon=True)
        self._thread.start()

    def record_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.sender.put([(k, float(v), now, step) for k, v in metrics.items()
                         if isinstance(v, (int, float)) and math.isfinite(float(v))])

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sampler.collect_metrics()
                if self._stop.wait(self.interval_s):
                    return
                self.sampler.publish_metrics(self.sampler.aggregate_metrics())
            except Exception:  # noqa: BLE001 - a sensor that fails is no reason to stop the stage
                log.info("system metrics: sampling failed", exc_info=True)
                self._stop.wait(self.interval_s)

    def finish(self, timeout_s: float = 10.0) -> int:
        """Stops sampling; gives the points still buffered `timeout_s` to reach the server (returns those that
        did not)."""
        self._stop.set()
        self._thread.join(timeout_s)
        return self.sender.close(timeout_s)


def start_workflow_run(tracking_uri: str, experiment: str, run_name: str, config: dict[str, Any],
                       tags: dict[str, str], artifact_root: str | None = None) -> RunLogger:
    """The parent run of a workflow (inactive when tracking_uri is empty: tracking off). An empty `run_name` names
    it `<config> #<n> · <date time>` (workflow_run_name). The experiment is created with its description
    (EXPERIMENT_TAGS); an existing one gets the tags it lacks and the current version of the project's description,
    and keeps a description of the user's own."""
    if not tracking_uri:
        return RunLogger(None)
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        # A SQLite store has no artifact root of its own: keep artifacts beside the database, not in ./mlruns.
        location = None
        if artifact_root and tracking_uri.startswith("sqlite:"):
            location = "file://" + artifact_root
        experiment_id = client.create_experiment(experiment, artifact_location=location, tags=EXPERIMENT_TAGS)
    else:
        experiment_id = exp.experiment_id
        for key, value in EXPERIMENT_TAGS.items():
            current = exp.tags.get(key, "")
            if not current or (current.startswith(OUR_NOTE) and current != value):  # missing, or an older one of ours
                client.set_experiment_tag(experiment_id, key, value)
    config_name = tags.get("bertpipe.config", "custom")
    run_name = run_name or workflow_run_name(config_name, _next_number(client, experiment_id, config_name))
    run = client.create_run(experiment_id, run_name=run_name, tags={"bertpipe.kind": "workflow", **mask_data(tags),
                                                                     "mlflow.note.content": _workflow_note(tags)})
    # The metric sender's settings travel with the coordinates, to the training workers that log into the run.
    settings = (config.get("mlflow") if isinstance(config, dict) else None) or {}
    sender = {key: str(settings[key]) for key in ("buffer_points", "flush_timeout_s") if key in settings}
    parent = RunLogger({"tracking_uri": tracking_uri, "experiment_id": experiment_id, "run_id": run.info.run_id,
                        **sender})
    parent.log_params(config)
    parent.log_dict(config, "resolved_config.json")
    return parent


def attach_bytes(coordinates: dict[str, str], blob: bytes, name: str, artifact_path: str) -> bool:
    """`blob` as the artifact <artifact_path>/<name> of the run at `coordinates`, which may have ended (the CLI
    attaches a remote workdir's log file when the run is over). Best effort: False when the store refused it."""
    return _best_effort(RunLogger(coordinates).log_bytes, mask(strip_ansi(blob.decode("utf-8", "replace"))).encode(),
                        name, artifact_path) is not None


def _workflow_note(tags: dict[str, str]) -> str:
    """The workflow run's description (what MLflow shows on its page)."""
    commit = tags.get("bertpipe.git_commit", "unknown")
    code = "" if commit == "unknown" else f" at git commit `{commit}`" + (
        " with uncommitted changes" if tags.get("bertpipe.git_dirty") == "true" else "")
    stages = " → ".join(tags.get("bertpipe.stages", "").split(",")) or "no stage"
    return (f"`bertpipe run` with the config **{tags.get('bertpipe.config', 'custom')}**{code}: {stages}, one child "
            "run per stage. Params: the whole resolved config. Metrics: the headline figures of the committed "
            "outputs, one value each (`pretrain/...`, `glue/...`).\n")


def workflow_run_name(config_name: str, number: int, when: float | None = None) -> str:
    """`tiny #3 · 2026-11-25 06:10`: the number first, so two runs differ in the part the runs table shows."""
    return f"{config_name} #{number} · {time.strftime('%Y-%m-%d %H:%M', time.localtime(when))}"


def _next_number(client, experiment_id: str, config_name: str) -> int:
    """1 + the workflow runs of `config_name` in the experiment so far, deleted ones included (a number is never
    given twice, unless two runs start at the same moment)."""
    from mlflow.entities import ViewType

    count, token = 0, None
    while True:
        page = client.search_runs([experiment_id], "tags.`bertpipe.kind` = 'workflow'", run_view_type=ViewType.ALL,
                                  max_results=1000, page_token=token)
        count += sum(r.data.tags.get("bertpipe.config") == config_name for r in page)
        token = page.token
        if not token:
            return count + 1


def kill_run_tree(tracking_uri: str, run_id: str) -> list[str]:
    """Mark `run_id` and every run below it (nested through `mlflow.parentRunId`, fine-tuning's trials included)
    that is still RUNNING as KILLED; returns the ids it marked. Runs already ended keep their status."""
    client = _client(tracking_uri)
    root = client.get_run(run_id)
    experiment = root.info.experiment_id
    marked, frontier = [], [root]
    while frontier:
        run = frontier.pop()
        if run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, "KILLED")
            marked.append(run.info.run_id)
        frontier += client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run.info.run_id}'",
                                       max_results=10000)
    return marked


def close_abandoned(tracking_uri: str, run_id: str, why: str) -> list[str]:
    """A workflow run whose driver ended without closing it (kill -9, a lost machine): it and every run below it
    still RUNNING become KILLED, the workflow run tagged with `why`. Returns the ids marked."""
    marked = kill_run_tree(tracking_uri, run_id)
    if run_id in marked:
        client = _client(tracking_uri)
        client.set_tag(run_id, "bertpipe.status", "killed")
        client.set_tag(run_id, "bertpipe.error", mask(why))
    return marked


def check_server(tracking_uri: str, experiment: str, timeout_s: float = SERVER_CHECK_TIMEOUT_S) -> str:
    """For an http(s) tracking URI: "" when an MLflow server answers there, else why not, in one line. One request,
    no retries, `timeout_s` to connect and as much to answer: the first call MLflow makes for a run (the experiment
    by name), with the credentials MLflow itself would send. Other stores (a SQLite file) are not checked here."""
    if not tracking_uri.startswith(("http://", "https://")):
        return ""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    where = f"the MLflow server at {mask(tracking_uri)}"
    try:
        response = http_request(get_default_host_creds(tracking_uri), "/api/2.0/mlflow/experiments/get-by-name",
                                "GET", max_retries=0, timeout=timeout_s, raise_on_status=False,
                                params={"experiment_name": experiment})
    except MlflowException as exc:
        return f"{where} does not answer ({_connection_problem(exc, timeout_s)})"
    if response.status_code == 200:
        return ""
    try:
        code = response.json().get("error_code", "")
    except ValueError:
        code = ""
    if response.status_code == 404 and code == "RESOURCE_DOES_NOT_EXIST":
        return ""  # a server that does not know the experiment yet: the run creates it
    if response.status_code in (401, 403):
        return f"{where} refuses this run's credentials (HTTP {response.status_code}{', ' + code if code else ''})"
    return (f"{where} answers HTTP {response.status_code}{' ' + code if code else ''} to an MLflow API request: "
            "is it an MLflow tracking server?")


def _connection_problem(exc: BaseException, timeout_s: float) -> str:
    import requests

    if isinstance(exc.__cause__, requests.exceptions.Timeout) or "timeout" in str(exc).lower():
        return f"no answer within {timeout_s:g} s"
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(exc))
    return errno.group(1).strip() if errno else mask(str(exc).splitlines()[0])[:300]

"""Screenshots of a run's MLflow UI in headless Chromium: the experiment, the workflow run, the pre-training
charts and the registered model's page, as a user opening `make ui` sees them.

Needs Debian's chromium (`apt-get install chromium`); not part of the suite (a look, not an assertion).

    python benchmarks/mlflow_screenshots.py work/tiny --out /tmp/shots
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1600,1000", "--virtual-time-budget=15000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pages(store: str) -> dict[str, str]:
    """{name: URL fragment} of the four pages, found through the tracking API."""
    import mlflow

    client = mlflow.MlflowClient(store)
    exp = client.get_experiment_by_name("bertpipe")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=200)
    workflow = next(r for r in runs if r.data.tags.get("bertpipe.kind") == "workflow")
    pretrain = next(r for r in runs if r.data.tags.get("bertpipe.stage") == "pretrain")
    model = client.search_registered_models()[0].name
    base = f"#/experiments/{exp.experiment_id}"
    return {"experiment": base, "workflow_run": f"{base}/runs/{workflow.info.run_id}",
            "pretrain_charts": f"{base}/runs/{pretrain.info.run_id}/model-metrics", "model": f"#/models/{model}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("mlflow-screenshots"))
    args = parser.parse_args()
    store = f"sqlite:///{(args.workdir / 'mlflow.db').resolve()}"
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ui = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri", store,
                           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or ui.poll() is not None:
                    raise SystemExit("the MLflow UI did not start")
                time.sleep(1)
        for name, fragment in pages(store).items():
            shot = (args.out / f"{name}.png").resolve()
            subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={args.out.resolve() / '.profile'}",
                            f"--screenshot={shot}", f"http://127.0.0.1:{port}/{fragment}"],
                           check=True, capture_output=True, timeout=180)
            print(f"{name:16} {shot}")
    finally:
        ui.terminate()
        ui.wait(timeout=30)


if __name__ == "__main__":
    main()

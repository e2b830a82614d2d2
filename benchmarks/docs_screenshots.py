"""The README's screenshots (docs/img/*.png), taken from a real run in a real browser: headless Chromium driven over
the DevTools protocol, so that pages can be waited for, MLflow's assistant panel kept closed and the Ray
dashboard's token cookie set, as a user who has pasted the token once sees it.

    python benchmarks/docs_screenshots.py mlflow work/tiny --out docs/img
    python benchmarks/docs_screenshots.py ray http://127.0.0.1:8265 --token-file TOKEN_FILE --job JOB_ID --out docs/img

`mlflow` serves the workdir's store with `mlflow ui` on a free loopback port for the shots and stops it; `ray` shoots
a dashboard that is up (the job's page and the cluster page: nodes and worker processes). Needs Debian's chromium
(`apt-get install chromium`); not part of the suite (a look, not an assertion). PNGs over 300 KB are reduced to a
256-colour palette.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

WIDTH, HEIGHT = 1600, 1000
MAX_BYTES = 300_000
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
# MLflow 3's assistant panel opens by itself on a first visit and covers a third of the page.
MLFLOW_STORAGE = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
                  "MLflowLocalStorage-1.1-ExperimentView-1-expandRows": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise SystemExit(f"{url} did not answer")
            time.sleep(0.5)


class Browser:
    """One headless Chromium tab, driven over the DevTools protocol."""

    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method: str, **params):
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json()
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def open(self, url: str, wait_for: str, clicks: tuple[str, ...] = (), timeout_s: float = 60,
                   settle_s: float = 3) -> None:
        """Navigate, wait until the page's text holds `wait_for`, run each of `clicks` (JavaScript), then let charts
        finish drawing."""
        await self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while wait_for not in (await self.evaluate("document.body ? document.body.innerText : ''") or ""):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}: {wait_for!r} never appeared")
            await asyncio.sleep(0.5)
        for click in clicks:
            await asyncio.sleep(1)
            await self.evaluate(click)
        await asyncio.sleep(settle_s)

    async def shoot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        data = shrink(base64.b64decode(shot["data"]))
        path.write_bytes(data)
        print(f"{path}  {len(data) // 1024} KB")


def shrink(png: bytes) -> bytes:
    """The PNG as it is, or as a 256-colour palette image when it is over MAX_BYTES (screenshots of a UI lose
    nothing visible)."""
    if len(png) <= MAX_BYTES:
        return png
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


async def with_browser(work) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        chromium = subprocess.Popen(["chromium", *CHROMIUM_FLAGS, f"--remote-debugging-port={port}",
                                     f"--user-data-dir={profile}", "about:blank"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/json/version", 30, chromium)
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
            page = next(t for t in targets if t["type"] == "page")
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    browser = Browser(ws)
                    await browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                                       deviceScaleFactor=1, mobile=False)
                    await browser.call("Page.enable")
                    await work(browser)
        finally:
            chromium.terminate()
            chromium.wait(timeout=30)


# The runs table's row expanders: the workflow run's (the first), then the glue stage run's (the last once the first
# is open), so the table shows the stage runs and GLUE's task runs.
EXPANDERS = "Array.from(document.querySelectorAll('button[data-component-id*=runnamecellrenderer]'))"
EXPAND_RUNS = (f"{EXPANDERS}[0].click()", f"{EXPANDERS}.slice(-1)[0].click()")


def mlflow_pages(store: str) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(file name, URL fragment, text to wait for, clicks) of the README's MLflow pictures, found through the
    tracking API."""
    import mlflow

    client = mlflow.MlflowClient(store)
    exp = client.get_experiment_by_name("bertpipe")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=500)
    workflow = next(r for r in runs if r.data.tags.get("bertpipe.kind") == "workflow")
    pretrain = next(r for r in runs if r.data.tags.get("bertpipe.stage") == "pretrain")
    model = client.search_registered_models()[0].name
    base, ml = f"#/experiments/{exp.experiment_id}", "workflowType=machine_learning"
    return [("mlflow_runs", f"{base}/runs?{ml}", workflow.info.run_name.split(" · ")[0], EXPAND_RUNS),
            ("mlflow_pretrain_charts", f"{base}/runs/{pretrain.info.run_id}/model-metrics?{ml}", "mlm_accuracy", ()),
            ("mlflow_model", f"#/models/{model}?{ml}", "Version 1", ())]


def shoot_mlflow(workdir: Path, out: Path) -> None:
    store = f"sqlite:///{(workdir / 'mlflow.db').resolve()}"
    port = free_port()
    ui = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri", store,
                           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/"

    async def work(browser: Browser) -> None:
        await browser.call("Page.navigate", url=base)
        await asyncio.sleep(2)
        for key, value in MLFLOW_STORAGE.items():
            await browser.evaluate(f"localStorage.setItem({json.dumps(key)}, {json.dumps(value)})")
        for name, fragment, wait_for, clicks in mlflow_pages(store):
            await browser.open(base + fragment, wait_for, clicks)
            await browser.shoot(out / f"{name}.png")

    try:
        wait_http(base + "health", 120, ui)
        asyncio.run(with_browser(work))
    finally:
        ui.terminate()
        ui.wait(timeout=30)


# The job page with the driver's log newest line first: the run's console (stage lines, the progress line) shows.
RAY_JOB_CLICKS = ("document.querySelector('input.MuiSwitch-input').click()",)


def shoot_ray(dashboard: str, token_file: Path | None, job: str, out: Path) -> None:
    base = dashboard.rstrip("/") + "/"

    async def work(browser: Browser) -> None:
        if token_file is not None:  # what the dashboard's login sets once a user has pasted the token
            await browser.call("Network.setCookie", name="ray-authentication-token",
                               value=token_file.expanduser().read_text().strip(), url=base)
        await browser.open(f"{base}#/jobs/{job}", job, RAY_JOB_CLICKS, settle_s=5)
        await browser.shoot(out / "ray_job.png")
        await browser.open(f"{base}#/cluster", "Node ID", settle_s=5)
        await browser.shoot(out / "ray_cluster.png")

    asyncio.run(with_browser(work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ml = sub.add_parser("mlflow", help="the runs, the pre-training charts and the registered model of a workdir")
    ml.add_argument("workdir", type=Path)
    ray = sub.add_parser("ray", help="a job's page and the cluster page of a Ray dashboard")
    ray.add_argument("dashboard")
    ray.add_argument("--token-file", type=Path)
    ray.add_argument("--job", required=True, help="the job's submission id")
    for p in (ml, ray):
        p.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "mlflow":
        shoot_mlflow(args.workdir, args.out)
    else:
        shoot_ray(args.dashboard, args.token_file, args.job, args.out)


if __name__ == "__main__":
    main()

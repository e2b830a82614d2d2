"""A local Ray whose raylet misses Ray's fixed 30 s to register (a loaded machine) is started once more, with
nothing left of the first attempt: a real Ray, with Ray's clock made to run past its wait once."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# In a fresh process: Ray's wait for its raylet sees its clock jump past 30 s, once, while the node is not yet known
# (what a raylet slow to register looks like to ray.init); the second attempt finds its node.
ONCE_TOO_SLOW = r"""
import logging, time, types
import psutil
import ray._private.node as ray_node
import ray._private.services as services
from bertpipe.jobs import cluster

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
real_get_node, real_time = services.get_node, ray_node.time
calls = []
jumped = types.SimpleNamespace(sleep=time.sleep, monotonic=lambda: real_time.monotonic() + 31)

def slow_then_registered(*args, **kwargs):
    calls.append(len(calls))
    if len(calls) == 1:
        ray_node.time = jumped
        raise RuntimeError("the node is not in the GCS yet")
    ray_node.time = real_time
    return real_get_node(*args, **kwargs)

services.get_node = slow_then_registered
import ray
joined = cluster.ensure_ray(num_cpus=1, dashboard=False)
print("node-lookups", len(calls))
print("sum", ray.get(ray.remote(lambda: 41 + 1).remote()))
import os
import json
print("node-env", json.dumps(ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in cluster.NODE_ENV}).remote())))
names = [p.name() for p in psutil.Process().children(recursive=True)]
print("gcs", sum(n.startswith("gcs_server") for n in names), "raylets", sum(n == "raylet" for n in names))
cluster.stop_writers(joined.how)
print("left", len(psutil.Process().children(recursive=True)))
"""


@pytest.mark.integration
def test_a_raylet_slow_to_register_costs_one_more_start_and_leaves_nothing_behind(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env["HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", ONCE_TOO_SLOW], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "did not register within Ray's 30 s" in out.stderr, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["sum"] == "42"
    assert int(lines["node-lookups"]) >= 2, out.stdout  # the first attempt's, then the second's
    # the local Ray's workers run with the project's node settings (jobs/cluster.py NODE_ENV)
    from bertpipe.jobs.cluster import NODE_ENV

    assert json.loads(lines["node-env"]) == NODE_ENV, out.stdout
    # one GCS and one raylet: the first attempt's were stopped, not left beside the second's
    assert lines["gcs"] == "1 raylets 1", out.stdout
    assert lines["left"] == "0", out.stdout

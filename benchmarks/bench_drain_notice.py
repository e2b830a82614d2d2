"""How long after a node's drain request (`ray drain-node`, a cloud's spot notice) Ray Train knows of it, per poll
interval of its preemption watcher (`RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`: Ray's default 5 s, the project's 1 s,
bertpipe.jobs.cluster.NODE_ENV). Real Ray nodes on this host (ray.cluster_utils.Cluster): each 1-CPU node runs an
actor, as a node holding a training worker does (Ray lets an idle drained node go at once), and Ray Train's own
PreemptionWatcher watches it; the drain goes to the GCS as the CLI sends it, at a different phase of the poll each
time, and the latency is until the watcher holds the notice (it then tells the workers, who see it at their next
`pretrain.drain_check_every_steps`).

    python benchmarks/bench_drain_notice.py [--samples 6] [--intervals 5 1]
"""
from __future__ import annotations

import argparse
import statistics
import time


def latencies(interval_s: float, samples: int) -> list[float]:
    """Seconds from each drain request to the watcher's notice, one fresh busy node per sample."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1)
    class Busy:
        def ready(self) -> bool:
            return True

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(samples)]
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        gcs = ray._raylet.GcsClient(address=cluster.address)
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        found, holders = [], []
        for i, node in enumerate(nodes):
            holder = Busy.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
            ray.get(holder.ready.remote())
            holders.append(holder)
            watcher = ray.remote(num_cpus=0)(PreemptionWatcher).remote(node_to_ranks={node.node_id: [0]},
                                                                        poll_interval_s=interval_s)
            ray.get(watcher.get_latest_preemption_info.remote())
            time.sleep(interval_s * ((i * 0.37) % 1))  # spread the requests over the poll's phase
            asked = time.time()
            accepted, why = gcs.drain_node(node.node_id, reason, "bench", int((time.time() + 60) * 1000))
            assert accepted, why
            while ray.get(watcher.get_latest_preemption_info.remote()) is None:
                time.sleep(0.01)
            found.append(time.time() - asked)
            ray.kill(watcher)
        return found
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--intervals", type=float, nargs="+", default=[5.0, 1.0])
    args = parser.parse_args()
    rows = [(interval, latencies(interval, args.samples)) for interval in args.intervals]
    print(f"\n{'poll interval':>13} | {'samples, s':<40} | {'mean':>5} | {'max':>5}")
    print(f"{'-' * 13}-+-{'-' * 40}-+-{'-' * 5}-+-{'-' * 5}")
    for interval, found in rows:
        print(f"{interval:>11.1f} s | {' '.join(f'{x:.2f}' for x in found):<40} | {statistics.mean(found):5.2f} | "
              f"{max(found):5.2f}")
    base = statistics.mean(rows[0][1])
    for interval, found in rows[1:]:
        print(f"mean notice at {interval:.1f} s vs {rows[0][0]:.1f} s: {statistics.mean(found) / base:.2f}x")


if __name__ == "__main__":
    main()

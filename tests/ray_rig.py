"""A multi-node Ray cluster on one host, in a process of its own (tests/multinode.py drives it): Ray's
`ray.cluster_utils.Cluster`, a head and worker nodes, each a real raylet with its own resources.

    python tests/ray_rig.py --head-cpus 1 --node-cpus 2 --node-cpus 2 --answer-fd 1

writes one JSON line {"address": ..., "nodes": [node ids]} to the answer file descriptor once every node is up,
then takes commands on stdin, one per line, answering each with one JSON line there:
    add <cpus>          a worker node joins (as an autoscaler would add one)            -> {"added": node id}
    kill-train-node     kill -9 of the raylet of a worker node that hosts a Ray Train worker
                        (remove_node(..., allow_graceful=False))                         -> {"killed": node id}
    kill-busy-node      the same for a worker node with CPUs in use (a task runs there)  -> {"killed": node id}
    kill <node id>      the same for that node (a drained node taken at its deadline)   -> {"killed": node id}
    busy                the worker nodes with CPUs in use                                -> {"busy": [...]}
    nodes               the alive nodes                                                  -> {"alive": [...]}
    quit                every node stops                                                 -> {"stopped": true}
In its own process so that the tests' session Ray never sees it, and Ray's processes all end with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def answer_channel(fd: int):
    """Where answers go, one JSON line each: stdout (fd 1), or a pipe of the caller's that Ray's processes, which
    share the rig's stdout, never write into."""
    if fd == 1:
        out = sys.stdout
    else:
        os.set_inheritable(fd, False)  # Ray's processes must not hold the answer pipe open
        out = os.fdopen(fd, "w")

    def say(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return say


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-cpus", type=float, default=1)
    ap.add_argument("--node-cpus", type=float, action="append", default=[])
    ap.add_argument("--answer-fd", type=int, default=1)
    args = ap.parse_args()
    say = answer_channel(args.answer_fd)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": args.head_cpus, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=c) for c in args.node_cpus]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    say({"address": cluster.address, "nodes": [n.node_id for n in nodes]})
    try:
        for line in sys.stdin:
            cmd, *rest = line.split()
            if cmd == "add":
                node = cluster.add_node(num_cpus=float(rest[0]))
                nodes.append(node)
                cluster.wait_for_nodes()
                say({"added": node.node_id})
            elif cmd == "kill-train-node":
                victim = _train_node(nodes)
                cluster.remove_node(victim, allow_graceful=False)
                nodes.remove(victim)
                say({"killed": victim.node_id, "at": time.time()})
            elif cmd == "kill-busy-node":
                victim = _busy_node(nodes)
                cluster.remove_node(victim, allow_graceful=False)
                nodes.remove(victim)
                say({"killed": victim.node_id, "at": time.time()})
            elif cmd == "kill":
                victim = next(n for n in nodes if n.node_id == rest[0])
                cluster.remove_node(victim, allow_graceful=False)
                nodes.remove(victim)
                say({"killed": victim.node_id, "at": time.time()})
            elif cmd == "busy":
                say({"busy": [n.node_id for n in nodes if _in_use(n.node_id)]})
            elif cmd == "nodes":
                say({"alive": [n["NodeID"] for n in ray.nodes() if n["Alive"]]})
            elif cmd == "quit":
                break
    finally:
        ray.shutdown()
        cluster.shutdown()
        say({"stopped": True})


def _in_use(node_id: str) -> bool:
    import ray
    from ray._private import state

    total = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
    free = state.available_resources_per_node().get(node_id, {}).get("CPU", 0)
    return free < total.get(node_id, 0)


def _busy_node(nodes: list):
    """A worker node (not the head) some of whose CPUs a task or actor holds."""
    for node in nodes:
        if _in_use(node.node_id):
            return node
    raise RuntimeError("no worker node has a CPU in use")


def _train_node(nodes: list):
    """A worker node (not the head) that hosts a live Ray Train worker."""
    from ray._private import state

    hosting = {info["Address"]["NodeID"] for info in state.actors().values()
               if info.get("ActorClassName", "").endswith("RayTrainWorker") and info.get("State") == "ALIVE"}
    for node in nodes:
        if node.node_id in hosting:
            return node
    raise RuntimeError(f"no worker node hosts a Ray Train worker (they are on {sorted(hosting)})")


if __name__ == "__main__":
    main()

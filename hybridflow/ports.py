"""Rendezvous ports for torch.distributed worlds. Imports nothing heavy: on a cluster of several
nodes a worker group runs :func:`node_ip_and_free_port` as a Ray task on rank 0's node, whose
worker process imports this module (on one node the driver calls it itself)."""
from __future__ import annotations

import random
import socket


RAY_WORKER_PORTS_END = 19999  # ray start --max-worker-port's default


def free_rendezvous_port(host: str = "") -> int:
    """A port for rank 0's TCPStore that no outgoing connection will take first.

    The usual trick, bind port 0 and release it, returns a port from the kernel's ephemeral range;
    between the release and the store's own bind (seconds later, after the other ranks start),
    any process's outgoing TCP connection (gloo, Ray) may be given that same port, and the store
    then fails with EADDRINUSE. Measured: starting seven 2-rank groups at once on 2 cores did.
    Ports below the ephemeral range are never handed out implicitly, so pick one of those that
    binds now, and fall back to the usual trick only if none does. The pick starts above Ray's
    default worker ports (10002-19999), which Ray takes without asking: a store there can make
    `ray start` refuse to run ("worker_ports is trying to use a port number ... used by other
    components", seen in the Slurm test) or a later worker fail to bind.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = RAY_WORKER_PORTS_END + 1
    for port in random.Random().sample(range(low, ephemeral_low), k=max(0, min(64, ephemeral_low - low))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip_and_free_port() -> tuple[str, int]:
    """(this node's IP, a free rendezvous port): run on the node of a group's rank 0."""
    import ray

    return ray.util.get_node_ip_address(), free_rendezvous_port()

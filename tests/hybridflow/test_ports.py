import random
import socket

from hybridflow.ports import RAY_WORKER_PORTS_END, free_rendezvous_port


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_port_is_bindable_between_rays_worker_ports_and_the_ephemeral_range():
    """An outgoing connection never gets a port below the ephemeral range, so the store's later
    bind cannot lose it to one (the EADDRINUSE race of bind-to-0-and-release); Ray's worker
    ports (up to 19999) are Ray's."""
    for _ in range(20):
        port = free_rendezvous_port("127.0.0.1")
        assert RAY_WORKER_PORTS_END < port < _ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_returned(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken_port = taken.getsockname()[1]
    try:
        # every candidate is the taken port: the function must fall back, not return it
        monkeypatch.setattr(random.Random, "sample", lambda self, population, k: [taken_port] * k)
        port = free_rendezvous_port("127.0.0.1")
        assert port != taken_port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    finally:
        taken.close()

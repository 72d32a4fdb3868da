"""bench.services.free_port: a port nothing is bound to, below the kernel's ephemeral range, and
under pytest-xdist only one of this worker's own residue, so two workers never pick the same port."""
import socket

from bench import services
from bench.services import PORT_RANGE, free_port


def test_a_worker_gets_only_ports_of_its_own_residue(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        assert {free_port() % 3 for _ in range(20)} == {int(worker[2:])}


def test_without_xdist_any_free_port_of_the_range_that_a_server_can_then_bind(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    ports = {free_port() for _ in range(40)}
    assert len({port % 2 for port in ports}) == 2 and all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in ports)
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))
        server.listen()
        taken = server.getsockname()[1]
        picks = iter([taken, taken + 1])                 # the bound port first: passed over
        monkeypatch.setattr(services.random, "randrange", lambda low, high: next(picks))
        assert free_port() == taken + 1

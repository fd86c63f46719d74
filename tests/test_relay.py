"""The relay to the coordinator: bytes both ways, and the coordinator's loss seen before the client's."""

import socket
import threading

import pytest

from jax_dp.relay import Relay


@pytest.fixture
def coordinator():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def relayed(coordinator):
    """(relay, the client's socket, the coordinator's side of that connection, the lost event)."""
    lost = threading.Event()
    relay = Relay(f"127.0.0.1:{coordinator.getsockname()[1]}", lost.set)
    host, port = relay.address.split(":")
    client = socket.create_connection((host, int(port)), timeout=5)
    upstream, _ = coordinator.accept()
    upstream.settimeout(5)
    return relay, client, upstream, lost


def test_bytes_pass_both_ways_and_a_client_that_closes_loses_nothing(coordinator):
    relay, client, upstream, lost = relayed(coordinator)
    client.sendall(b"ping")
    assert upstream.recv(4) == b"ping"
    upstream.sendall(b"pong" * 50_000)
    got = b""
    while len(got) < 200_000:
        got += client.recv(1 << 16)
    assert got == b"pong" * 50_000
    client.close()
    assert upstream.recv(1) == b""  # The relay closed the coordinator's side too,
    assert not lost.wait(0.5) and not relay.lost.is_set()  # and saw no loss in it.


def test_the_coordinators_loss_is_reported_once_and_the_client_sees_silence(coordinator):
    relay, client, upstream, lost = relayed(coordinator)
    client.sendall(b"ping")
    assert upstream.recv(4) == b"ping"
    upstream.close()
    assert lost.wait(5) and relay.lost.is_set()
    client.settimeout(0.5)
    with pytest.raises(socket.timeout):  # Open and silent: no EOF, no reset.
        client.recv(1)
    client.sendall(b"still writable")


def test_an_error_after_the_coordinators_loss_names_process_0(monkeypatch):
    """Whatever the error says (a save, a key-value read), once the relay saw the coordinator
    go the run names process 0; before, an error that names no lost process is just itself."""
    from jax_dp import distributed

    relay = type("Seen", (), {"lost": threading.Event()})()
    monkeypatch.setattr(distributed, "_relay", relay)
    assert distributed.lost_process(RuntimeError("DEADLINE_EXCEEDED: GetKeyValue")) is None
    relay.lost.set()
    assert distributed.lost_process(RuntimeError("DEADLINE_EXCEEDED: GetKeyValue")) == (
        "process 0", "its coordinator's connection closed")

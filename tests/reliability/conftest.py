import pytest

from tests.reliability.hostile_server import HostileServer


@pytest.fixture
def hostile():
    """A scripted misbehaving server (tests/reliability/hostile_server.py), stopped after the test."""
    servers: list[HostileServer] = []

    def start(routes=None) -> HostileServer:
        servers.append(HostileServer(routes))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()

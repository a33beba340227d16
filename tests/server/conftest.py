"""A real `tokenmill serve` on 127.0.0.1, started by the tests."""

from __future__ import annotations

import time

import httpx
import pytest

from tokenmill.loadgen.server_process import ServerProcess

API_KEY = "test-key"
MODEL = "smollm2"


class Server(ServerProcess):
    def __init__(self, *flags: str, one_model: bool = True) -> None:
        """``one_model``: the default model, named MODEL, in float32; else ``flags`` say what to serve."""
        base = ["--served-model-name", MODEL, "--kv-cache-memory", "384MiB", "--dtype", "float32"] if one_model else []
        super().__init__([*base, *flags], timeout=120)  # (8,192-token context; float32: batch-invariant)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of metric `name` whose labels include `labels`."""
        total, found = 0.0, False
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total


@pytest.fixture(scope="session")
def server():
    s = Server("--api-key", API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def server_idle_after(request):
    """Every server test must leave no request running and the KV pool free."""
    yield
    if "server" in request.fixturenames:
        s = request.getfixturevalue("server")
        deadline = time.time() + 10
        while time.time() < deadline:
            if s.metric("tokenmill:num_requests_running") == 0 and s.metric("tokenmill:kv_cache_usage_perc") == 0:
                return
            time.sleep(0.1)
        raise AssertionError("the server still holds requests or KV blocks after the test")

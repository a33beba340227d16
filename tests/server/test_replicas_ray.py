"""Engine replicas on Ray Serve, through a real `tokenmill serve`: one server with a
prefill replica and two decode replicas (disaggregated serving, KV-routed decode pool)
carries every check, since a Ray cluster takes seconds to start. Skipped without the
`ray` extra (`pip install 'tokenmill[ray]'`; `make test` installs it)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import process_alive, wait_until
from tests.server.conftest import MODEL, Server

pytest.importorskip("ray.serve", reason="engine replicas need Ray Serve: pip install 'tokenmill[ray]'")

LONG = (
    "A serving engine keeps each request's keys and values in fixed-size blocks of a shared pool. When two "
    "requests begin with the same system prompt, the blocks that hold it are computed once and shared. "
)


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    s = Server("--prefill-replicas", "1", "--decode-replicas", "2")
    yield s
    assert s.stop(60) == 0  # SIGTERM: drained, Serve and Ray stopped, exit 0
    pids = getattr(s, "replica_pids", set())  # (seen by the tests that ran)
    assert wait_until(lambda: not any(process_alive(p) for p in pids), 30), "replica processes left behind"


def descendants(pid: int) -> list[int]:
    from tests.helpers import child_pids

    out, todo = [], [pid]
    while todo:
        for c in child_pids(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def replica_pids(server: Server, role: str) -> list[int]:
    """The processes of the server's replicas of one pool (Ray names them ray::ServeReplica:...)."""
    pids = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except FileNotFoundError:
            continue
        if cmd.startswith(f"ray::ServeReplica:tokenmill-{role}:"):
            pids.append(pid)
    server.replica_pids = getattr(server, "replica_pids", set()) | set(pids)
    return pids


def complete(server: Server, prompt, max_tokens: int = 24, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_disaggregated_decoding_is_token_identical_to_one_engine(cluster, llm):
    """Prompts of several lengths (one shorter than a block: no prefill needed): the
    text equals the single offline engine's, and the decode replicas decoded from KV
    the prefill replica shipped (blocks moved, found in their prefix caches)."""
    from tokenmill.sampling_params import SamplingParams

    assert len(replica_pids(cluster, "decode")) == 2 and len(replica_pids(cluster, "prefill")) == 1
    prompts = [LONG + "Say why sharing helps.", "Hi", LONG * 3 + "In one sentence: what is a block?"]
    for text in prompts:
        ids = llm.tokenizer.encode(text)
        (ref,) = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))
        assert complete(cluster, ids)["choices"][0]["text"] == ref.outputs[0].text, text
    assert wait_until(lambda: cluster.metric("tokenmill:kv_transfer_imported_blocks_total") > 0, 5)
    blocks = cluster.metric("tokenmill:kv_transfer_blocks_total")
    assert blocks >= (len(llm.tokenizer.encode(prompts[0])) // 16) + (len(llm.tokenizer.encode(prompts[2])) // 16)
    assert cluster.metric("tokenmill:kv_transfer_requests_total") == 2  # "Hi" went straight to a decode replica
    assert cluster.metric("tokenmill:kv_transfer_fallbacks_total") == 0
    assert cluster.metric("tokenmill:kv_transfer_bytes_total") > 0
    usable = sum(
        (len(llm.tokenizer.encode(p)) - 1) // 16 * 16 for p in (prompts[0], prompts[2])
    )  # the last block is computed

    def decode_hits() -> float:
        return sum(cluster.metric("tokenmill:prefix_cache_hits_total", replica=r) for r in _replicas(cluster, "decode"))

    assert wait_until(lambda: decode_hits() >= usable, 5), (decode_hits(), usable)  # every shipped block was used


def _replicas(server: Server, pool: str) -> list[str]:
    names = set()
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("tokenmill:num_requests_running{") and f'replica="{pool}/' in line:
            names.add(line.split('replica="', 1)[1].split('"', 1)[0])
    return sorted(names)


def test_a_follow_up_turn_is_routed_to_the_replica_holding_its_conversation(cluster):
    """Multi-turn chat: the second turn extends the first's prompt; the router sends
    it to the decode replica that cached the first (a "prefix" decision)."""
    before = _settled(lambda: _decisions(cluster, "prefix"))  # the front's view of the index lags up to 1 s
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "What is shared?"}]
    first = httpx.post(
        cluster.url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0},
    ).json()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And why does it save memory?"}]
    r = httpx.post(
        cluster.url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0},
    )
    assert r.status_code == 200
    assert wait_until(lambda: _decisions(cluster, "prefix") >= before + 1, 5)
    assert _settled(lambda: _decisions(cluster, "prefix")) == before + 1
    assert len(_replicas(cluster, "decode")) == 2 and len(_replicas(cluster, "prefill")) == 1


def test_each_decode_replica_routes_at_the_price_of_load_it_measured(cluster):
    """Every decode replica measured on its engine, at start, what a request in flight
    costs a newcomer, and reports it with its load: the router's price per replica
    (/metrics), "measured" (not the default), within the clamp."""
    from tokenmill.engine.core.load_price import PRICE_RANGE

    def prices() -> dict[str, float]:
        lines = httpx.get(cluster.url + "/metrics", timeout=10).text.splitlines()
        return {
            line.split('replica="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("tokenmill:router_load_cost_tokens{")
            and 'pool="decode"' in line
            and 'source="measured"' in line
        }

    assert wait_until(lambda: len(prices()) == 2, 10), prices()
    assert all(PRICE_RANGE[0] <= p <= PRICE_RANGE[1] for p in prices().values()), prices()


def _settled(read, period: float = 1.2):
    """A metric the front polls from the replicas' index (every second), once it stops
    changing."""
    last = read()
    while True:
        time.sleep(period)
        now = read()
        if now == last:
            return now
        last = now


def _decisions(server: Server, reason: str) -> float:
    try:
        return server.metric("tokenmill:router_decisions_total", pool="decode", reason=reason)
    except KeyError:
        return 0.0


def test_a_killed_decode_replica_fails_only_its_streams_and_is_replaced(cluster):
    """kill -9 one decode replica while streams run on both: its streams end with an
    error event and [DONE], the other replica's finish, a request sent right after is
    answered, Ray Serve starts a new replica, and nothing is left running."""
    results: list[str] = []

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"{i}: " + LONG, "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        results.append("error" if "error" in last else last["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert wait_until(
        lambda: (
            sum(cluster.metric("tokenmill:num_requests_running", replica=r) for r in _replicas(cluster, "decode")) == 4
        ),
        60,
    )
    running = [int(cluster.metric("tokenmill:num_requests_running", replica=r)) for r in _replicas(cluster, "decode")]
    assert min(running) >= 1, running  # no shared prefix: spread by load (2 and 2, or 3 and 1 if a report crossed)
    victim = replica_pids(cluster, "decode")[0]
    os.kill(victim, signal.SIGKILL)
    answer = complete(cluster, LONG + "Still there?", max_tokens=8)  # routed (or retried) to the live replica
    assert answer["choices"][0]["finish_reason"] == "length"
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a stream hung after its replica died"
    assert len(results) == 4 and set(results) == {"error", "length"}, results
    assert results.count("error") in running, (results, running)  # exactly the victim's streams failed
    assert wait_until(lambda: len(replica_pids(cluster, "decode")) == 2 and len(_replicas(cluster, "decode")) == 2, 90)
    assert wait_until(lambda: cluster.metric("tokenmill:num_requests_running") == 0, 10)
    assert complete(cluster, "Hi", max_tokens=4)["choices"][0]["finish_reason"] == "length"


def test_serve_run_of_the_deploy_config_serves_our_api_from_two_replicas(tmp_path):
    """deploy/ray-serve.yaml's application under Ray Serve's own `serve run` (its HTTP
    proxy, our app as the ingress deployment), two data-parallel replicas: a chat is
    answered and /metrics shows both replicas. Stopped with Ctrl-C, as a user would."""
    import subprocess
    import sys

    import yaml

    from tokenmill.loadgen.server_process import free_port

    config = yaml.safe_load(open(Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"))
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args.pop("max_replicas"), args.pop("target_ongoing_requests")
    args.update(served_model_name=MODEL, replica_cpus=0, replica_threads=1, kv_cache_memory="128MiB")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "serve"), "run", str(path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _up(url) or proc.poll() is not None, 180) and proc.poll() is None, proc.stderr.read()
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert wait_until(lambda: len(_replica_labels(url, "engine")) == 2, 10)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _replica_labels(url: str, pool: str) -> list[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sorted(
        {
            line.split('replica="', 1)[1].split('"', 1)[0]
            for line in text.splitlines()
            if line.startswith("tokenmill:num_requests_running{") and f'replica="{pool}/' in line
        }
    )

"""/metrics under vLLM's own names and labels, beside ours: the families vLLM serves (the issue's
list), and the queries of the Grafana dashboard vLLM ships (examples/observability/prometheus_grafana/
grafana.json, its panels' selectors written here as data) answered by a scrape after some traffic."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL

# name -> kind, as vLLM serves them (each with the label model_name)
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}

# The dashboard's series: (sample name, labels its query groups by), every one selected by
# {model_name="$model_name"}; its template variable is label_values(model_name).
DASHBOARD = [
    ("vllm:e2e_request_latency_seconds_bucket", "le"),
    ("vllm:e2e_request_latency_seconds_sum", None),
    ("vllm:e2e_request_latency_seconds_count", None),
    ("vllm:prompt_tokens_total", None),
    ("vllm:generation_tokens_total", None),
    ("vllm:inter_token_latency_seconds_bucket", "le"),
    ("vllm:inter_token_latency_seconds_sum", None),
    ("vllm:inter_token_latency_seconds_count", None),
    ("vllm:num_requests_running", None),
    ("vllm:num_requests_waiting", None),
    ("vllm:time_to_first_token_seconds_bucket", "le"),
    ("vllm:time_to_first_token_seconds_sum", None),
    ("vllm:time_to_first_token_seconds_count", None),
    ("vllm:kv_cache_usage_perc", None),
    ("vllm:request_prompt_tokens_bucket", "le"),
    ("vllm:request_generation_tokens_bucket", "le"),
    ("vllm:request_success_total", "finished_reason"),
    ("vllm:request_queue_time_seconds_sum", None),
    ("vllm:request_prefill_time_seconds_sum", None),
    ("vllm:request_decode_time_seconds_sum", None),
    ("vllm:request_max_num_generation_tokens_sum", None),
]


def scrape(http) -> dict[str, list]:
    """Sample name -> its samples."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


@pytest.fixture(scope="module")
def traffic(http_module):
    """Two finished requests, one streamed (several tokens: inter-token gaps)."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True}
    assert http_module.post("/v1/completions", json=body).status_code == 200
    with http_module.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.read()


@pytest.fixture(scope="module")
def http_module(server):
    import httpx

    from tests.server.conftest import API_KEY

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def test_vllms_families_are_served_with_model_name_beside_ours(http_module, traffic):
    kinds = {f.name: f.type for f in text_string_to_metric_families(http_module.get("/metrics").text)}
    for name, kind in VLLM_FAMILIES.items():
        assert kinds.get(name) == kind, name
        ours = "tokenmill:" + name.removeprefix("vllm:")
        assert name == "vllm:gpu_cache_usage_perc" or kinds.get(ours) == kind, ours  # ours kept
    samples = scrape(http_module)
    for name in VLLM_FAMILIES:
        got = [s for key, ss in samples.items() if key.startswith(name) for s in ss]
        assert got and all(s.labels.get("model_name") == MODEL for s in got), name


def test_the_dashboard_vllm_ships_finds_data_for_the_served_model(http_module, traffic):
    samples = scrape(http_module)
    assert MODEL in {s.labels["model_name"] for ss in samples.values() for s in ss if "model_name" in s.labels}
    for name, by in DASHBOARD:
        selected = [s for s in samples.get(name, []) if s.labels.get("model_name") == MODEL]
        assert selected, f"{name}{{model_name={MODEL!r}}} finds nothing"
        if by is not None:
            assert all(by in s.labels for s in selected), name
    positive = [
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_to_first_token_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
        "vllm:request_max_num_generation_tokens_sum",
    ]
    for name in positive:
        assert sum(s.value for s in samples[name] if s.labels["model_name"] == MODEL) > 0, name
    steps = [s for s in samples["vllm:iteration_tokens_total_count"] if s.labels["model_name"] == MODEL]
    assert steps[0].value > 0
    same = {
        s.labels["finished_reason"]: s.value
        for s in samples["vllm:request_success_total"]
        if s.labels["model_name"] == MODEL
    }
    ours = {
        s.labels["finished_reason"]: s.value
        for s in samples["tokenmill:request_success_total"]
        if s.labels["model_name"] == MODEL
    }
    assert same == ours and same.get("length", 0) >= 2

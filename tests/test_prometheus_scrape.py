"""A real Prometheus scrapes a live Tessera while requests run; then every query of our Grafana dashboard, and
the TTFT / ITL / tokens/s / queue queries of a vLLM dashboard against the `vllm:` aliases, must return data.

The server is the real app (create_app, with its own /metrics route and per-request tracking) over the real
AsyncEngine and a ScriptedRunner (no model), its steps counted as `tessera serve` counts them, driven with the openai
client over HTTP. Prometheus is Debian's package (`apt-get install prometheus`), started here on
loopback with a temporary storage dir and killed at the end.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from tessera.engine.serving.engine_loop import AsyncEngine
from tests.support.fake_runner import ScriptedRunner
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.server.app import create_app
from tessera.server.metrics import Metrics
from tessera.server.prepare import ModelInfo
from tessera.server.settings import Settings
from server_harness import free_port, make_tokenizer, serving

DASHBOARD = Path(__file__).resolve().parents[1] / "config" / "grafana" / "tessera.json"
MODEL_NAME = "tessera-scrape-test"
BYTES_PER_TOKEN = 1024
KV_BUDGET_TOKENS = 2000  # a request whose cache at prompt + max_tokens exceeds this is refused (never_fits)
RATE_WINDOW = "1m"  # stands in for Grafana's $__rate_interval: covers the whole run at a 1 s scrape interval

# As vLLM's own Grafana dashboard writes them (examples/online_serving/.../grafana.json).
VLLM_DASHBOARD_QUERIES = {
    "TTFT p95": 'histogram_quantile(0.95, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket'
                '{model_name="$model_name"}[$__rate_interval])))',
    "ITL p95": 'histogram_quantile(0.95, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket'
               '{model_name="$model_name"}[$__rate_interval])))',
    "TPOT p95": 'histogram_quantile(0.95, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket'
                '{model_name="$model_name"}[$__rate_interval])))',
    "E2E p99": 'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket'
               '{model_name="$model_name"}[$__rate_interval])))',
    "generation tokens/s": 'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    "prompt tokens/s": 'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    "running": 'vllm:num_requests_running{model_name="$model_name"}',
    "waiting": 'vllm:num_requests_waiting{model_name="$model_name"}',
    "KV cache usage": 'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    "finish reasons": 'sum by(finished_reason) (increase(vllm:request_success_total'
                      '{model_name="$model_name"}[$__rate_interval]))',
    # vLLM v1's prefix-cache counters (this query is ours: hits / queries, in tokens).
    "prefix cache hit rate": 'sum(rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval])) '
                             '/ sum(rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval]))',
}


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if found is None:
        pytest.skip("no `prometheus` binary: install Debian's package (apt-get install prometheus) to run this test")
    return found


@contextmanager
def tessera_server(tmp_path: Path) -> Iterator[str]:
    """The real app + engine on a free loopback port, metrics with vLLM aliases at /metrics."""
    tokenizer = make_tokenizer(tmp_path)
    settings = Settings(prefill_chunk=16, indexer_tile=16, max_num_seqs=2, memory_budget=4 * 2**20,
                        metrics_vllm_aliases=True)
    metrics = Metrics.from_settings(settings, MODEL_NAME, max_model_len=4096)
    runner = ScriptedRunner(vocab_size=tokenizer.vocab_size, step_delay_s=0.004, bytes_per_token=BYTES_PER_TOKEN)
    config = SchedulerConfig(prefill_chunk=16, max_num_seqs=2, max_model_len=4096,
                             memory_budget_bytes=KV_BUDGET_TOKENS * BYTES_PER_TOKEN,
                             prefix_cache_bytes=1)  # on, so prefix-cache queries are counted (the script never hits)
    engine = AsyncEngine(runner, config)  # no EOS: every request runs to max_tokens
    info = ModelInfo(name=MODEL_NAME, root="scripted", max_model_len=4096, created=int(time.time()))
    app = create_app(settings, engine, tokenizer, info, metrics)  # attach subscribes the metrics to the engine's steps
    engine.start()
    try:
        with serving(app) as base_url:
            yield base_url
    finally:
        engine.shutdown(1.0)


@contextmanager
def prometheus(tmp_path: Path, target: str) -> Iterator[str]:
    """Prometheus on a free loopback port scraping `target` (host:port) every second; yields its base URL."""
    binary = prometheus_binary()
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: tessera\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _http_ok(f"{base_url}/-/ready") or process.poll() is not None, 20, "Prometheus to start")
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()}")
        yield base_url
    finally:
        process.kill()
        process.wait(10)
        log.close()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def query(prometheus_url: str, promql: str) -> list[dict]:
    """An instant query through the HTTP API; the result vector."""
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(prometheus_url: str, promql: str) -> float:
    result = query(prometheus_url, promql)
    return float(result[0]["value"][1]) if result else math.nan


def grafana_to_promql(expr: str) -> str:
    """Fill in the dashboard's variables as Grafana would for this one server."""
    return (expr.replace("$__rate_interval", RATE_WINDOW)
                .replace("${model_name}", MODEL_NAME).replace("$model_name", MODEL_NAME))


def dashboard_exprs(node: Any) -> Iterator[tuple[str, str]]:
    """(panel title, expr) for every query in the dashboard JSON, however deep."""
    if isinstance(node, dict):
        for target in node.get("targets", []):
            yield node.get("title", "?"), target["expr"]
        for key, child in node.items():
            if key != "targets":
                yield from dashboard_exprs(child)
    elif isinstance(node, list):
        for child in node:
            yield from dashboard_exprs(child)


# ---- traffic --------------------------------------------------------------------------------------------


def drive_traffic(base_url: str, duration_s: float, num_clients: int = 5) -> int:
    """Streamed chat requests from `num_clients` threads for `duration_s` (more clients than max_num_seqs, so
    some wait), plus one request that can never fit the KV budget. Returns the number completed."""
    completed: list[int] = []
    errors: list[BaseException] = []
    deadline = time.monotonic() + duration_s

    def client_loop(index: int) -> None:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        while time.monotonic() < deadline:
            try:
                stream = client.chat.completions.create(
                    model=MODEL_NAME, stream=True, max_tokens=24,
                    messages=[{"role": "user", "content": f"client {index} says hello #{len(completed)}"}],
                )
                num_chunks = sum(1 for _ in stream)
                assert num_chunks > 0
                completed.append(index)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                return

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError):  # its cache at prompt + max_tokens exceeds the KV budget
        client.chat.completions.create(model=MODEL_NAME, max_tokens=KV_BUDGET_TOKENS + 100,
                                       messages=[{"role": "user", "content": "never fits"}])
    for thread in threads:
        thread.join(duration_s + 30)
    assert not errors, errors
    return len(completed)


# ---- the test ---------------------------------------------------------------------------------------------


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path):
    prometheus_binary()  # skip early, before building anything
    with tessera_server(tmp_path) as base_url, prometheus(tmp_path, base_url.removeprefix("http://")) as prom:
        wait_for(lambda: scalar(prom, 'up{job="tessera"}') == 1, 20, "the first successful scrape")
        num_completed = drive_traffic(base_url, duration_s=5.0)
        success = f'sum(tessera_request_success_total{{model_name="{MODEL_NAME}"}})'
        wait_for(lambda: scalar(prom, success) == num_completed, 15, "a scrape after the last request")

        missing = [f"{title}: {expr}" for title, expr in dashboard_exprs(json.loads(DASHBOARD.read_text()))
                   if not has_finite_value(query(prom, grafana_to_promql(expr)))]
        missing += [f"vLLM dashboard {name}: {expr}" for name, expr in VLLM_DASHBOARD_QUERIES.items()
                    if not has_finite_value(query(prom, grafana_to_promql(expr)))]
        assert not missing, "queries without data:\n" + "\n".join(missing)

        # The dashboard's model_name variable: label_values(tessera_num_requests_running, model_name).
        assert [r["metric"]["model_name"] for r in query(prom, "group by (model_name) (tessera_num_requests_running)")
                ] == [MODEL_NAME]
        # The queue gauges were seen busy, not just present: more clients than max_num_seqs.
        assert scalar(prom, f'max_over_time(vllm:num_requests_running[{RATE_WINDOW}])') == 2
        assert scalar(prom, f'max_over_time(vllm:num_requests_waiting[{RATE_WINDOW}])') >= 1
        assert scalar(prom, 'sum(tessera_admission_rejections_total{reason="never_fits"})') == 1
        assert scalar(prom, 'sum(vllm:generation_tokens_total)') == 24 * num_completed


def has_finite_value(result: list[dict]) -> bool:
    """Data, and not only NaN (histogram_quantile over buckets that never moved gives NaN)."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


def test_the_example_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no `promtool` (Debian's prometheus package ships it)")
    example = Path(__file__).resolve().parents[1] / "config" / "prometheus.yml"
    result = subprocess.run([promtool, "check", "config", str(example)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all('model_name=~"$model_name"' in target["expr"] for target in panel["targets"]), panel["title"]

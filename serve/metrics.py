"""Prometheus metrics for a serving EngineLoop (own registry; no global state).

Histograms (observed when a request finishes): TTFT, inter-token latency, time per output token,
queue time, end-to-end latency. Gauges and counters are read from `EngineLoop.stats()` at scrape
time, so they are never stale and the loop thread does no metric work for them: queue depth,
running slots, KV pages used/free/total, generated tokens, requests by outcome, health.
Speculative decoding does not exist yet: `jaxinfer_spec_acceptance_rate` is exported as NaN
so dashboards can be built now.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StatsCollector:
    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        s = self.loop.stats()
        for name, key, doc in (
            ("jaxinfer_queue_depth", "queue_depth", "Requests waiting for a decode slot"),
            ("jaxinfer_running_slots", "running", "Occupied decode slots"),
            ("jaxinfer_max_slots", "max_slots", "Decode slots"),
            ("jaxinfer_kv_pages_used", "pages_used", "KV cache pages in use"),
            ("jaxinfer_kv_pages_free", "pages_free", "KV cache pages free (incl. evictable cached)"),
            ("jaxinfer_kv_pages_total", "pages_total", "Usable KV cache pages"),
            ("jaxinfer_requests_in_flight", "in_flight", "Submitted and not yet finished"),
            ("jaxinfer_compilations", "compile_count", "Compiled step variants"),
        ):
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily("jaxinfer_healthy", "1 while the engine loop is healthy",
                                value=1.0 if s["healthy"] else 0.0)
        yield GaugeMetricFamily("jaxinfer_spec_acceptance_rate",
                                "Speculative decoding acceptance rate (NaN: not enabled)",
                                value=math.nan)
        yield CounterMetricFamily("jaxinfer_generated_tokens", "Generated tokens",
                                  value=s["tokens_generated"])
        yield CounterMetricFamily("jaxinfer_engine_steps", "Engine steps", value=s["steps"])
        c = CounterMetricFamily("jaxinfer_requests", "Requests by outcome", labels=["outcome"])
        for outcome, n in sorted(s["requests"].items()):
            c.add_metric([outcome], n)
        yield c


class ServingMetrics:
    def __init__(self, loop, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jaxinfer_ttft_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("jaxinfer_itl_seconds", "Inter-token latency", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("jaxinfer_tpot_seconds", "Time per output token after the first",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("jaxinfer_queue_seconds", "Arrival to first scheduled", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("jaxinfer_e2e_seconds", "Arrival to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        r.register(_StatsCollector(loop))
        loop.on_finish.append(self.observe)
        self._http = None

    def observe(self, state, outcome: str) -> None:
        """EngineLoop on_finish listener (loop thread): per-request latency histograms."""
        m = state.metrics.summary()
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"])
        if m["queue_s"] is not None:
            self.queue.observe(m["queue_s"])
        if outcome in ("stop", "length") and m["e2e_s"] is not None:
            self.e2e.observe(m["e2e_s"])
            n = len(state.token_ids)
            if n > 1 and m["ttft_s"] is not None:
                self.tpot.observe((m["e2e_s"] - m["ttft_s"]) / (n - 1))
        for x in m["itl_s"]:
            self.itl.observe(x)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (port 0 picks one)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def parse_text(body: str) -> dict[str, float]:
    """Flatten Prometheus text exposition into {'name{labels}': value} (tests and tools)."""
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out

"""Prometheus metrics for a serving EngineLoop (own registry; no global state).

Histograms (observed when a request finishes): TTFT, inter-token latency, time per output token,
queue time, end-to-end latency. Gauges and counters are read from `EngineLoop.stats()` at scrape
time, so they are never stale and the loop thread does no metric work for them: queue depth,
running slots, KV pages used/free/total, generated tokens, requests by outcome, health, and
speculative decoding's proposals verified / accepted since start with their ratio
(`jaxinfer_spec_acceptance_rate`, NaN until a proposal has been verified: without speculation,
or before its first verify step).
"""

from __future__ import annotations

import hmac
import math
import ssl
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StatsCollector:
    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        s = self.loop.stats()
        for name, key, doc in (
            ("jaxinfer_queue_depth", "queue_depth", "Sequences (prompts x samples) waiting for a decode slot"),
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
        proposed, accepted = s["spec_proposed"], s["spec_accepted"]
        yield GaugeMetricFamily("jaxinfer_spec_acceptance_rate",
                                "Accepted / verified speculative proposals since start (NaN: none "
                                "verified)", value=accepted / proposed if proposed else math.nan)
        yield CounterMetricFamily("jaxinfer_spec_proposed_tokens",
                                  "Speculative proposals verified", value=proposed)
        yield CounterMetricFamily("jaxinfer_spec_accepted_tokens",
                                  "Speculative proposals accepted", value=accepted)
        yield CounterMetricFamily("jaxinfer_generated_tokens", "Generated tokens",
                                  value=s["tokens_generated"])
        yield CounterMetricFamily("jaxinfer_engine_steps", "Engine steps", value=s["steps"])
        if "kv_host_slots" in s:  # the prefix cache's host tier (kv_host_cache_gb)
            yield GaugeMetricFamily("jaxinfer_kv_host_bytes_used", "Host tier bytes holding "
                                    "pages", value=s["kv_host_bytes_used"])
            yield GaugeMetricFamily("jaxinfer_kv_host_slots", "Host tier page slots",
                                    value=s["kv_host_slots"])
            for what in ("offloaded", "restored", "evicted"):
                yield CounterMetricFamily(f"jaxinfer_kv_host_pages_{what}",
                                          f"Pages {what} by the host tier",
                                          value=s[f"kv_host_pages_{what}"])
            p50 = s["kv_host_restore_s_per_page_p50"]
            yield GaugeMetricFamily("jaxinfer_kv_host_restore_seconds_per_page_p50",
                                    "Median host time of a restore, per page (NaN: none yet)",
                                    value=math.nan if p50 is None else p50)
        if "encoder_runs" in s:  # a vision model's encoder and its cache (runtime/images.py)
            yield CounterMetricFamily("jaxinfer_encoder_calls", "Vision encoder calls",
                                      value=s["encoder_runs"])
            yield CounterMetricFamily("jaxinfer_images_encoded", "Images the vision encoder ran "
                                      "on (cache misses)", value=s["images_encoded"])
            yield CounterMetricFamily("jaxinfer_encoder_cache_hits", "Images served from the "
                                      "encoder cache", value=s["encoder_cache_hits"])
            yield GaugeMetricFamily("jaxinfer_encoder_cache_bytes", "Bytes the encoder cache "
                                    "holds", value=s["encoder_cache_bytes"])
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
        # latency targets (EngineConfig.itl_slo_ms / ttft_slo_ms): per completed request
        s = loop.stats()
        self.ttft_target_s, self.itl_target_s = s.get("ttft_target_s"), s.get("itl_target_s")
        self.slo_met = Counter("jaxinfer_slo_met", "Completed requests within a latency target",
                               ["target"], registry=r)
        self.slo_missed = Counter("jaxinfer_slo_missed", "Completed requests past a latency "
                                  "target", ["target"], registry=r)
        self.goodput = Counter("jaxinfer_goodput_requests", "Completed requests within every "
                               "latency target set (all completed ones when none is)", registry=r)
        r.register(_StatsCollector(loop))
        loop.on_finish.append(self.observe)
        self._http = None

    def observe(self, out, outcome: str) -> None:
        """EngineLoop on_finish listener (loop thread): per-request latency histograms of a
        finished request's RequestOutput."""
        m = out.metrics
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"])
        if m["queue_s"] is not None:
            self.queue.observe(m["queue_s"])
        if outcome in ("stop", "length") and m["e2e_s"] is not None:
            self.e2e.observe(m["e2e_s"])
            n = len(out.token_ids)
            if n > 1 and m["ttft_s"] is not None:
                self.tpot.observe((m["e2e_s"] - m["ttft_s"]) / (n - 1))
        for x in m["itl_s"]:
            self.itl.observe(x)
        if outcome in ("stop", "length"):
            self._attainment(m)

    def _attainment(self, m: dict) -> None:
        """A request meets the TTFT target when its first token came within it, the ITL target
        when its slowest gap did (every token on time, as a client sees it)."""
        checks = {}
        if self.ttft_target_s is not None and m["ttft_s"] is not None:
            checks["ttft"] = m["ttft_s"] <= self.ttft_target_s
        if self.itl_target_s is not None:
            checks["itl"] = max(m["itl_s"], default=0.0) <= self.itl_target_s
        for target, ok in checks.items():
            (self.slo_met if ok else self.slo_missed).labels(target).inc()
        if all(checks.values()):
            self.goodput.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int, *, auth_token: str | None = None,
                   tls_cert: str | None = None, tls_key: str | None = None) -> int:
        """Start the /metrics HTTP endpoint in a thread; returns the bound port (port 0 picks
        one). With `auth_token` a scrape needs `Authorization: Bearer <token>` (401 otherwise);
        with `tls_cert`/`tls_key` it is HTTPS only. The serving layer passes the server's own
        token and TLS unless started with --metrics-public."""
        app = make_wsgi_app(self.registry)
        if auth_token:
            app = _bearer_only(app, auth_token)
        server = make_server(host, port, app, server_class=_ThreadingWSGIServer,
                             handler_class=_QuietHandler)
        if tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_cert, tls_key)
            # the handshake runs in the request's own thread (first read), not in accept()
            server.socket = ctx.wrap_socket(server.socket, server_side=True,
                                            do_handshake_on_connect=False)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._http = server
        return server.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _bearer_only(app, token: str):
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(got, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", "Bearer")])
        return [b"missing or invalid bearer token\n"]

    return guarded


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # a client that connects and sends nothing does not hold a thread for long

    def log_message(self, format, *args):  # noqa: A002 - no access log per scrape
        pass

    def handle(self):
        try:
            super().handle()
        except (ssl.SSLError, ConnectionError, TimeoutError):
            pass  # a plaintext client on the TLS port, or one that went away


def parse_text(body: str) -> dict[str, float]:
    """Flatten Prometheus text exposition into {'name{labels}': value} (tests and tools)."""
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out

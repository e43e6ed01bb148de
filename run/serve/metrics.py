"""`GET /metrics`: the server's Prometheus metrics, named as vLLM's under a `qwen3_spmd:`
prefix, so vLLM's dashboards port by renaming the prefix.

Each `Service` has its own registry (not prometheus_client's global one): several
servers in one process (tests) count apart. Two kinds of metric:

- read when scraped (`_Now`): requests running and waiting, rows busy, the programs
  the engine has compiled and the seconds rounds waited for compiles, the prefix
  cache's queries and hits (in prompt tokens, as vLLM counts them), evictions and blocks;
  with speculative decoding, the drafts, draft tokens and accepted tokens;
- counted as choices end (`Metrics.ended`): prompt and generation tokens, finished
  requests by reason, time to first token, time per output token, end-to-end latency;
  a pooling runner's requests (`Metrics.pooled`) count their prompt tokens, reason and
  latency; and the requests refused with a 503 (`Metrics.rejected`).

Every metric carries the label `model_name` (the served name), as vLLM's do. With
several processes, process 0 serves HTTP and so the metrics: its own compiles, the
job's requests.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "qwen3_spmd:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
TPOT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
E2E_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """The metrics of one Service (`service.scheduler` is read when scraped)."""

    def __init__(self, service):
        self.model_name = service.settings.model_name
        self.registry = CollectorRegistry()
        self.registry.register(_Now(service))

        def counter(name, doc, labels=()):
            return Counter(P + name, doc, ["model_name", *labels], registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(P + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self._generation_tokens = counter(
            "generation_tokens", "Tokens generated (the responses' completion_tokens)."
        )
        self._success = counter(
            "request_success", "Choices ended, by finish reason.", ["finished_reason"]
        )
        self._rejected = counter(
            "request_rejected", "Requests refused with 503 by the full queue.", ["reason"]
        )
        self._ttft = histogram(
            "time_to_first_token_seconds", "From submit to the first token.", TTFT_BUCKETS
        )
        self._tpot = histogram(
            "time_per_output_token_seconds",
            "A choice's mean time per token after its first.",
            TPOT_BUCKETS,
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds", "From submit to the choice's end.", E2E_BUCKETS
        )

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def pooled(self, handle, submitted: float) -> None:
        """A pooling request (`Service.pool`) ended: its prompt, its reason, its latency
        (from `submitted`, a perf_counter reading); it generates no token."""
        name = self.model_name
        self._prompt_tokens.labels(name).inc(handle.prompt_tokens)
        self._success.labels(name, handle.finish_reason).inc()
        self._e2e.labels(name).observe(time.perf_counter() - submitted)

    def ended(self, choice, reason: str) -> None:
        """A choice (`service.Choice`) ended with `reason` ("stop", "length", "cancelled",
        "error"): its tokens and times. Its prompt counts once it was prefilled."""
        name, handle = self.model_name, choice.handle
        times = handle.token_times_s[: choice.count]  # seconds since submit, per token
        if times:
            self._prompt_tokens.labels(name).inc(handle.prompt_tokens)
            self._ttft.labels(name).observe(times[0])
        if len(times) > 1:
            self._tpot.labels(name).observe((times[-1] - times[0]) / (len(times) - 1))
        self._generation_tokens.labels(name).inc(choice.count)
        self._success.labels(name, reason).inc()
        self._e2e.labels(name).observe(time.perf_counter() - choice.submitted)


class _Now:
    """The metrics read from the scheduler and the engine when scraped."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        scheduler, name = self.service.scheduler, [self.service.settings.model_name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(P + metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(P + metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge("num_requests_running", "Requests in a decode row.", scheduler.running)
        yield gauge("num_requests_waiting", "Requests waiting for a row.", scheduler.waiting)
        yield gauge(
            "num_rows_busy",
            "Decode rows that hold a request (or a long prompt being prefilled).",
            scheduler.rows_busy,
        )
        yield gauge("num_rows", "Decode rows (--max-batch, rounded to the groups).", scheduler.B)
        # by data-parallel replica, under vLLM's label for its data-parallel ranks
        starts = CounterMetricFamily(
            P + "replica_requests_started",
            "Requests each data replica started in its rows (a preempted one again).",
            labels=["model_name", "engine"],
        )
        for d, n in enumerate(scheduler.replica_starts):
            starts.add_metric(name + [str(d)], n)
        yield starts
        yield counter(
            "engine_compiles",
            "Programs compiled (prefill and decode shapes; the background's included).",
            len(scheduler.engine.programs.compiled),
        )
        yield gauge(
            "engine_compiles_left",
            "Program shapes the background has still to compile after start-up.",
            scheduler.compiles_left,
        )
        yield counter(
            "engine_compile_wait_seconds",
            "Seconds rounds waited for a compile.",
            scheduler.clock.compile_s,
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of the KV cache's pages the requests hold (vLLM's).",
            scheduler.kv_usage,
        )
        yield gauge("kv_cache_pages", "Pages of the KV cache's pool.", scheduler.pages)
        yield counter(
            "num_preemptions",
            "Requests preempted when the KV cache's pages ran out (prefilled again later).",
            scheduler.preemptions,
        )
        yield gauge(
            "kv_cache_tokens", "Tokens the KV cache's pages hold in all.", scheduler.kv_tokens
        )
        p = scheduler.prefix  # None without a prefix cache: every figure 0
        queries, hits, evictions, held = (
            (p.queries, p.hits, p.evictions, p.blocks_held) if p else (0, 0, 0, 0)
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (every admitted prompt's).",
            queries,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens whose K/V the prefix cache gave (not computed).",
            hits,
        )
        yield counter(
            "prefix_cache_evictions", "Named blocks whose pages went to other rows.", evictions
        )
        yield gauge(
            "prefix_cache_blocks",
            "Blocks named in the KV cache's pages (held by rows, or kept for later prompts).",
            held,
        )
        spec = scheduler.speculator  # as vLLM, only when speculation is on
        if spec is not None:
            m = spec.metrics
            yield counter(
                "spec_decode_num_drafts", "Verify passes of a row that carried drafts.", m.drafts
            )
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", m.draft_tokens)
            yield counter(
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted (the mean acceptance length is 1 + accepted / drafts).",
                m.accepted_tokens,
            )

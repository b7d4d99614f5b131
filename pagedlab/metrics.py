"""The server's ``/metrics``, in Prometheus' text format under vLLM's metric names.

Gauges and counters of the engine's state are read when Prometheus scrapes (a collector over
the :class:`~pagedlab.engine.async_llm.AsyncLLM`): requests running and waiting, the share of
KV blocks in use, preemptions, prefix-cache queries and hits, speculative decoding's drafts
and acceptances (in total and by position in the draft). Per-request numbers are
observed by the server as each request ends: prompt and generated tokens, successes, and the
latencies a client sees (time to first token, inter-token latency, end to end), in seconds of
the wall clock, since a server's clients live by it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """The engine's live state, read at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        llm = self.engine.llm
        scheduler, manager = llm.scheduler, llm.manager
        prefix = manager.prefix_stats
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "vllm:num_requests_running", "Requests in the running batch.",
                           len(scheduler.running))
        yield self._family(gauge, "vllm:num_requests_waiting", "Requests waiting or swapped.",
                           len(scheduler.waiting) + len(scheduler.swapped))
        yield self._family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 is all blocks.",
                           manager.num_used_blocks / manager.num_gpu_blocks)
        yield self._family(counter, "vllm:num_preemptions", "Preemptions since start.",
                           self.engine.num_preemptions)
        yield self._family(counter, "vllm:prefix_cache_queries",
                           "Prompt tokens looked up in the prefix cache.",
                           prefix.hits + prefix.misses)
        yield self._family(counter, "vllm:prefix_cache_hits",
                           "Prompt tokens found in the prefix cache.", prefix.hits)
        spec = scheduler.spec_stats
        for name, doc, value in (
                ("num_drafts", "Drafts verified.", spec.num_drafts),
                ("num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
                ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
            yield self._family(counter, f"vllm:spec_decode_{name}", doc, value)
        per_position = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft.",
                               labels=[*self.labels, "position"])
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([*self.labels.values(), str(position)], value)
        yield per_position


class ServerMetrics:
    """One registry per server: the engine's collector and the per-request observations."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.model_name = model_name

        def make(kind, name, doc, **kw):
            return kind(name, doc, ["model_name"], registry=self.registry, **kw).labels(
                model_name)

        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Generated tokens.")
        self.request_success = make(Counter, "vllm:request_success", "Requests finished.")
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds",
                         "Time to the first generated token.", buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds",
                        "Time between two outputs of a request.", buckets=LATENCY_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds",
                        "Time from arrival to the last token.", buckets=LATENCY_BUCKETS)

    def finished(self, out, arrival: float, times: list[float]) -> None:
        """Record a finished request: its output, when it arrived, when each output came."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        self.request_success.inc()
        if times:
            self.ttft.observe(times[0] - arrival)
            self.e2e.observe(times[-1] - arrival)
            for before, after in zip(times, times[1:]):
                self.itl.observe(after - before)


def scrape(page: str) -> dict[str, float]:
    """The ``vllm:*`` samples of a ``/metrics`` page by sample name, histogram buckets and
    labels left out: a client's view. Prometheus names a counter's sample ``<name>_total``
    (``vllm:num_preemptions_total``), so read a counter by that name, and index the result
    (``m[name]``) rather than ``m.get(name, 0)``: a misspelt name then fails loudly."""
    return {s.name: s.value for family in text_string_to_metric_families(page)
            for s in family.samples
            if s.name.startswith("vllm:") and not s.name.endswith("_bucket")}

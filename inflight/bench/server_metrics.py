"""What a server's Prometheus `/metrics` says about its KV cache, its batch, its queue, its
preemptions and its failures, read alike from every major engine.

Each engine names these figures its own way: `DIALECTS` holds the names of each, taken from the
engine's source at the version given in `Dialect.source` (docs/bench.md lists them). A scrape is
parsed with prometheus_client's own parser and read through the dialect of the engine that wrote
it, recognized by its names (or named: `inflight bench --server-kind`). A figure the engine does
not expose stays None, and a report says "not exposed" rather than guessing it.

Behind a fleet or a data-parallel engine a figure has one series per replica (label sets): the
KV usage keeps the fullest pool (an SLA's KV watermark bounds any one pool), everything else is
summed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from inflight.engine.stats import METRICS

# Sample name -> (labels, value) of each of its series.
Series = dict[str, list[tuple[dict[str, str], float]]]


class ExpositionError(ValueError):
    """A /metrics body that is not Prometheus's text format."""


def parse_exposition(text: str, only: Collection[str] | None = None) -> Series:
    """Every sample of a Prometheus text exposition, by sample name (a counter's `_total` and
    `_created`, a histogram's `_bucket`, `_sum`, `_count` each their own name). With `only`
    (`Dialect.sample_names`), the lines of other families are dropped before parsing: vLLM's
    52 KB of histograms cost 14 ms of parsing a scrape, the few gauges and counters a gate
    reads a fraction of that."""
    from prometheus_client.parser import text_string_to_metric_families

    if only is not None:
        text = "\n".join(line for line in text.splitlines() if _family_of(line) in only) + "\n"

    series: Series = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise ExpositionError(f"not Prometheus text format: {exc}") from None
    return series


def _family_of(line: str) -> str:
    """The metric name a line of the text format is about: a sample's, or a `# HELP`/`# TYPE`
    comment's ("" for other comments and blank lines)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop)
        if at != -1:
            end = min(end, at)
    return line[:end]


@dataclass(frozen=True, slots=True)
class Pick:
    """One figure from the series of sample `name` whose labels match `where` (a value, a tuple
    of values, or a prefix ending in "*"): the highest value (a pool's gauge) or the sum
    (counts), scaled by `scale`."""

    name: str
    where: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    how: Literal["max", "sum"] = "sum"
    scale: float = 1.0

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, want in self.where.items():
            have = labels.get(key)
            if have is None:
                return False
            if isinstance(want, tuple):
                if have not in want:
                    return False
            elif want.endswith("*"):
                if not have.startswith(want[:-1]):
                    return False
            elif have != want:
                return False
        return True

    def value(self, series: Series) -> float | None:
        # prometheus_client's parser names a counter's samples `..._total` even where the engine
        # wrote them without (TGI, Triton): the name as written, or as parsed.
        found = series.get(self.name) or series.get(self.name + "_total") or []
        values = [v for labels, v in found if self.matches(labels) and not math.isnan(v)]
        if not values:
            return None
        return (max(values) if self.how == "max" else sum(values)) * self.scale


@dataclass(frozen=True, slots=True)
class Ratio:
    """A usage made of two figures, `used / total` (an engine that counts blocks, not shares)."""

    used: Pick
    total: Pick

    def value(self, series: Series) -> float | None:
        used, total = self.used.value(series), self.total.value(series)
        if used is None or not total:
            return None
        return used / total


# The engine-neutral counters a run reports as their rise over the run.
COUNTERS = ("preemptions", "oom_errors", "failed_requests", "kv_allocation_failures",
            "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_lookups", "spec_found")


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one engine names the figures a pre-launch gate reads.

    kv_usage: the share of the KV cache in use (0..1); running / waiting: requests in the batch
    and queued; preemptions: requests whose KV was taken back (to recompute or swap); oom_errors:
    requests or steps failed for want of memory; failed_requests: requests the server itself
    ended in error or aborted; kv_allocation_failures: times a running request found no free
    KV block; kv_peak: a gauge of the pool's peak usage over the server's life; spec_drafts,
    spec_draft_tokens, spec_accepted_tokens: speculative decoding's verifying steps of a request,
    the tokens they proposed and those kept; spec_lookups, spec_found: lookups of proposals in a
    request's own tokens and those that found one (inflight's own)."""

    kind: str
    source: str  # where the names come from: repository, version, file
    markers: tuple[str, ...]  # sample names that only this engine writes (any one identifies it)
    kv_usage: Pick | Ratio | None = None
    running: Pick | None = None
    waiting: Pick | None = None
    preemptions: Pick | None = None
    oom_errors: Pick | None = None
    failed_requests: Pick | None = None
    kv_allocation_failures: Pick | None = None
    kv_peak: Pick | None = None
    kv_live: Pick | None = None
    spec_drafts: Pick | None = None
    spec_draft_tokens: Pick | None = None
    spec_accepted_tokens: Pick | None = None
    spec_lookups: Pick | None = None
    spec_found: Pick | None = None

    def read(self, series: Series) -> Reading:
        def get(pick: Pick | Ratio | None) -> float | None:
            return None if pick is None else pick.value(series)

        counters = {name: value for name in COUNTERS if (value := get(getattr(self, name))) is not None}
        return Reading(get(self.kv_usage), get(self.running), get(self.waiting), counters,
                       get(self.kv_peak), get(self.kv_live))

    def sample_names(self) -> frozenset[str]:
        """The metric names this dialect reads, as samples and as families (a counter with and
        without `_total`): what `parse_exposition(..., only=)` keeps."""
        picks: list[Pick] = []
        for name in ("kv_usage", "running", "waiting", *COUNTERS, "kv_peak", "kv_live"):
            pick = getattr(self, name)
            picks += [pick.used, pick.total] if isinstance(pick, Ratio) else [pick] if pick is not None else []
        return frozenset(n for p in picks for n in (p.name, p.name + "_total", p.name.removesuffix("_total")))



@dataclass(frozen=True, slots=True)
class Reading:
    """One scrape in engine-neutral terms; None where the engine does not expose a figure."""

    kv_usage: float | None
    running: float | None
    waiting: float | None
    counters: dict[str, float]
    kv_peak: float | None = None
    kv_live: float | None = None

    @property
    def exposed(self) -> list[str]:
        """The figures this scrape held, by their engine-neutral names."""
        gauges = {"kv_usage": self.kv_usage, "running": self.running, "waiting": self.waiting}
        return [name for name, value in gauges.items() if value is not None] + list(self.counters)


def _inflight(name: str, how: Literal["max", "sum"] = "sum") -> Pick:
    return Pick(METRICS[name].scraped_name, how=how)


_MAX: Literal["max"] = "max"
DIALECTS: dict[str, Dialect] = {d.kind: d for d in [
    Dialect(
        "inflight", "this repository: inflight/engine/stats.py (METRICS), inflight/server/metrics.py",
        markers=(METRICS["kv_cache_usage_perc"].scraped_name,),
        kv_usage=_inflight("kv_cache_usage_perc", _MAX),
        running=_inflight("num_requests_running"),
        waiting=_inflight("num_requests_waiting"),
        preemptions=_inflight("num_preemptions"),
        oom_errors=_inflight("num_oom_errors"),
        failed_requests=Pick("inflight:request_failure_total", {"reason": "error"}),
        kv_allocation_failures=_inflight("num_kv_allocation_failures"),
        kv_peak=_inflight("kv_cache_usage_peak_perc", _MAX),
        kv_live=_inflight("kv_cache_live_token_perc", _MAX),
        spec_drafts=_inflight("spec_decode_num_drafts"),
        spec_draft_tokens=_inflight("spec_decode_num_draft_tokens"),
        spec_accepted_tokens=_inflight("spec_decode_num_accepted_tokens"),
        spec_lookups=_inflight("spec_decode_num_lookups"),
        spec_found=_inflight("spec_decode_num_lookups_found"),
    ),
    # A fraction despite "perc"; labels engine and model_name. finished_reason "error" (a request
    # failed inside the engine, answered 500) exists from 0.34 on; 0.11 has stop/length/abort.
    Dialect(
        "vllm", "vllm 0.11.0 and 0.34.0 (PyPI sdists): vllm/v1/metrics/loggers.py, PrometheusStatLogger",
        markers=("vllm:kv_cache_usage_perc",),
        kv_usage=Pick("vllm:kv_cache_usage_perc", how=_MAX),
        running=Pick("vllm:num_requests_running"),
        waiting=Pick("vllm:num_requests_waiting"),
        preemptions=Pick("vllm:num_preemptions_total"),
        failed_requests=Pick("vllm:request_success_total", {"finished_reason": "error"}),
        spec_drafts=Pick("vllm:spec_decode_num_drafts_total"),
        spec_draft_tokens=Pick("vllm:spec_decode_num_draft_tokens_total"),
        spec_accepted_tokens=Pick("vllm:spec_decode_num_accepted_tokens_total"),
    ),
    Dialect(
        "vllm-v0", "vllm 0.6.3 (PyPI sdist): vllm/engine/metrics.py, Metrics",
        markers=("vllm:gpu_cache_usage_perc",),
        kv_usage=Pick("vllm:gpu_cache_usage_perc", how=_MAX),
        running=Pick("vllm:num_requests_running"),
        waiting=Pick("vllm:num_requests_waiting"),
        preemptions=Pick("vllm:num_preemptions_total"),
    ),
    # token_usage leaves evictable prefix-cache tokens out of "used"; retractions are SGLang's
    # preemptions (a counter from 0.5.10); its only failure count is HTTP responses by status.
    Dialect(
        "sglang", "sglang 0.5.23 (PyPI wheel): sglang/srt/observability/metrics_collector.py and "
        "observability/http_request_metrics.py; 0.5.6: srt/metrics/collector.py",
        markers=("sglang:token_usage", "sglang:num_running_reqs"),
        kv_usage=Pick("sglang:token_usage", how=_MAX),
        running=Pick("sglang:num_running_reqs"),
        waiting=Pick("sglang:num_queue_reqs"),
        preemptions=Pick("sglang:num_retracted_requests_total"),
        failed_requests=Pick("sglang:http_responses_total", {"status_code": "5*"}),
    ),
    # `--metrics` only (else 501). The KV figures (used cells / whole context) were removed in
    # mid-2025 (present at llama.cpp 8733e0c, gone at 8846aac): newer servers' KV usage is
    # estimated from /slots (`SLOTS_PATH`).
    Dialect(
        "llama.cpp", "llama.cpp 0c1e570 (llama-cpp-python 0.3.36 sdist): tools/server/server-task.cpp, "
        "to_metrics(); 8733e0c (0.3.9): tools/server/server.cpp, kv_cache_usage_ratio",
        markers=("llamacpp:requests_processing", "llamacpp:prompt_tokens_total"),
        kv_usage=Pick("llamacpp:kv_cache_usage_ratio", how=_MAX),
        running=Pick("llamacpp:requests_processing"),
        waiting=Pick("llamacpp:requests_deferred"),
    ),
    # Triton's TensorRT-LLM backend: gauges by category label; no preemption count. Failures:
    # Triton's own counter, less the requests the client cancelled.
    Dialect(
        "trtllm", "tensorrtllm_backend v0.19.0: inflight_batcher_llm/src/custom_metrics_reporter/"
        "custom_metrics_reporter.cc; triton core r26.06: src/metrics.cc",
        markers=("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics"),
        kv_usage=Ratio(Pick("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "used"}),
                       Pick("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "max"})),
        running=Pick("nv_trt_llm_request_metrics", {"request_type": "scheduled"}),
        waiting=Pick("nv_trt_llm_request_metrics", {"request_type": "waiting"}),
        failed_requests=Pick("nv_inference_request_failure", {"reason": ("BACKEND", "OTHER", "REJECTED")}),
    ),
    # No KV metric: the share of the token capacity the running batch has reserved is the nearest
    # (TGI admits by reserving prompt + max_new_tokens). Failures the server caused: generation,
    # dropped, incomplete (validation and template errors are the client's).
    Dialect(
        "tgi", "text-generation-inference v3.3.7: backends/v3/src (queue.rs, backend.rs, lib.rs), "
        "router/src/server.rs",
        markers=("tgi_batch_max_total_tokens", "tgi_queue_size", "tgi_batch_current_size"),
        kv_usage=Ratio(Pick("tgi_batch_current_max_tokens"), Pick("tgi_batch_max_total_tokens")),
        running=Pick("tgi_batch_current_size"),
        waiting=Pick("tgi_queue_size"),
        failed_requests=Pick("tgi_request_failure", {"err": ("generation", "dropped", "incomplete")}),
    ),
]}

# llama-server's per-slot state (on by default, `--no-slots` turns it off): each slot's context
# (`n_ctx`) and, once it has served a task, the tokens it holds (`n_prompt_tokens`: the prompt
# and what was generated, kept for reuse). Their ratio is the KV usage the server no longer exports.
SLOTS_PATH = "/slots"


def kv_usage_from_slots(slots: object) -> float | None:
    """Σ n_prompt_tokens / Σ n_ctx over llama-server's /slots answer; None if it is not one. With
    a unified KV cache (`--kv-unified`) slots share one pool and this overstates the usage."""
    if not isinstance(slots, list) or not slots:
        return None
    held = total = 0
    for slot in slots:
        if not isinstance(slot, dict) or not isinstance(slot.get("n_ctx"), int):
            return None
        total += slot["n_ctx"]
        tokens = slot.get("n_prompt_tokens", 0)
        held += tokens if isinstance(tokens, int) else 0
    return min(1.0, held / total) if total > 0 else None


SERVER_KINDS = tuple(DIALECTS)


def recognize(series: Series) -> Dialect | None:
    """The dialect whose names this scrape holds; None for an engine not listed."""
    for dialect in DIALECTS.values():
        if any(marker in series for marker in dialect.markers):
            return dialect
    return None


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by name, summed over label sets, except any engine's KV usage gauges, of
    which the highest is kept: a flat view for scripts that read a few names of one server."""
    highest = {pick.name for d in DIALECTS.values() for pick in (d.kv_usage, d.kv_peak, d.kv_live)
               if isinstance(pick, Pick)}
    values: dict[str, float] = {}
    for name, samples in parse_exposition(text).items():
        numbers = [v for _, v in samples]
        values[name] = max(numbers) if name in highest else sum(numbers)
    return values

"""The router's Prometheus metrics (its own registry: several routers may live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Only answers whose status says the worker ran the request (2xx) count as routed, here and
        # in routed_prompt_tokens, unknown_length and predicted_cached: the live planner sizes its
        # pools on them, and a refused request (a 400 for a prompt over max_model_len) ran no prefill.
        self.routed = Counter("kvtier_router_requests",
                              "Requests routed that the worker ran (answered 2xx), per worker; those it "
                              "refused are kvtier_router_refused_requests", ["worker"], registry=r)
        self.refused = Counter("kvtier_router_refused_requests",
                               "Requests a worker answered with a status other than 2xx (vLLM's 400 for a prompt "
                               "over max_model_len, a 413, a 429; not 502/503/504, retried elsewhere): in none "
                               "of the routed counters, as no worker ran them", ["worker", "status"], registry=r)
        self.no_inference = Counter("kvtier_router_no_inference_requests",
                                    "Requests a worker answered without running the model (GET /version, "
                                    "/tokenize, /detokenize, /v1/messages/count_tokens), by status: in none of "
                                    "the routed counters, which the live planner reads as load",
                                    ["worker", "status"], registry=r)
        self.predicted_cached = Counter("kvtier_router_predicted_cached_tokens",
                                        "Prompt tokens the router predicted cached on the chosen worker, of "
                                        "the requests it ran (answered 2xx)",
                                        ["worker"], registry=r)
        self.actual_cached = Counter("kvtier_router_actual_cached_tokens",
                                     "usage.prompt_tokens_details.cached_tokens reported by the worker",
                                     ["worker"], registry=r)
        self.prompt_tokens = Counter("kvtier_router_prompt_tokens", "usage.prompt_tokens reported by the worker",
                                     ["worker"], registry=r)
        # The requests prompt_tokens covers: a stream carries usage only when its client asked
        # (stream_options.include_usage), so prompt_tokens / requests understated prompts.
        self.usage_answers = Counter("kvtier_router_usage_answers",
                                     "Answers whose usage the router read (what prompt_tokens sums over)",
                                     ["worker"], registry=r)
        # The prompt lengths the router itself priced, for every request routed, streamed with or
        # without usage: the live planner's prompt mix (kvtier/planner/observe.py). Both series are
        # set for a worker at the first request it ran, so that "no length known" is told apart
        # from a router without them.
        self.routed_prompt_tokens = Counter("kvtier_router_routed_prompt_tokens",
                                            "Prompt tokens of the requests routed that the worker ran "
                                            "(answered 2xx), as the router priced them (the whole prompt, past "
                                            "max_route_tokens too; once per request, not per retry)", ["worker"],
                                            registry=r)
        self.unknown_length = Counter("kvtier_router_routed_unknown_length_requests",
                                      "Requests routed and run (answered 2xx) whose prompt length the router "
                                      "did not know (the Responses API, endpoints forwarded on load, prompt "
                                      "embeddings, a Messages request no worker rendered): routed_prompt_tokens / "
                                      "(requests - these) is the mean prompt", ["worker"], registry=r)
        self.decision = Histogram("kvtier_router_decision_seconds", "Time to pick a worker (keys + index + policy)",
                                  buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1), registry=r)
        self.approximate = Gauge("kvtier_router_approximate_mode",
                                 "1 while some worker's KV events are down and the router routes from its own decisions",
                                 registry=r)
        self.healthy = Gauge("kvtier_router_worker_healthy", "1 if the worker is admitted", ["worker"], registry=r)
        self.events_up = Gauge("kvtier_router_worker_events_up", "1 if the worker's KV events are connected",
                               ["worker"], registry=r)
        self.retries = Counter("kvtier_router_retries", "Requests retried on another worker before any byte",
                               registry=r)
        self.renders = Counter("kvtier_router_chat_renders",
                               "Chat prompts with tools or documents, by who rendered them (worker: its /tokenize; "
                               "router: its own template, when no worker could)", ["by"], registry=r)
        self.errors = Counter("kvtier_router_errors", "Requests answered with an error by the router", ["type"],
                              registry=r)
        self.resyncs = Counter("kvtier_router_event_resyncs",
                               "Times a worker's index entries were cleared to be rebuilt from its events "
                               "(reason: disconnected, restarted, gap)", ["worker", "reason"], registry=r)
        self.worker_blocks = Gauge("kvtier_router_worker_indexed_blocks",
                                   "Blocks the index holds as reported by the worker's own events", ["worker"],
                                   registry=r)
        self.read_bandwidth = Gauge("kvtier_router_tier_read_bytes_per_s",
                                    "Bandwidth the router prices loads with, per tier (source: default, flag, "
                                    "or the measurement file)", ["tier", "source"], registry=r)
        self.prefill_speed = Gauge("kvtier_router_worker_prefill_tokens_per_s",
                                   "Prefill speed the router measured per worker (0 until measured)", ["worker"],
                                   registry=r)
        self.decode_step = Gauge("kvtier_router_worker_decode_step_seconds",
                                 "Decode step the router measured per worker from its streams: the decode "
                                 "pressure tier-aware prices (0 until measured)", ["worker"], registry=r)
        self.held = Histogram("kvtier_router_admission_wait_seconds",
                              "Time a request waited in the router for its worker's queue to shorten "
                              "(kvtier.router.admission; 0 when sent at once)",
                              buckets=(1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0), registry=r)
        self.cut = Counter("kvtier_router_cut_responses",
                           "Answers that ended early after their first byte (reason: worker, the worker failed "
                           "or went silent mid-answer; client, the client left and the worker's request was "
                           "closed with it)", ["worker", "reason"], registry=r)
        self.aborts = Counter("kvtier_router_worker_aborts",
                              "Requests the router asked a worker to abort because their client left "
                              "(result: ok; refused, the worker answered an error status; failed, no answer; shared_name, not asked: "
                              "another request under way has the same client-given id; again, an abort sent again because "
                              "the client left before the worker's first byte, when the worker may not have had it yet "
                              "(not to one ejected or removed since); too_many, not asked: a batch of more engine requests "
                              "than one abort names; over_budget, not asked: "
                              "no room for its body in the router's bound on the abort bodies posted at once: 16 MiB in all, 4 MiB "
                              "to one worker, 1 MiB of it kept for bodies of at most 64 KiB, 128 KiB of that to one worker)",
                              ["worker", "result"], registry=r)
        self.ignored = Counter("kvtier_router_event_blocks_ignored",
                               "Blocks of KV events the router could not index (reason block_size: the worker's "
                               "vLLM --block-size is not the router's --block-tokens; kv_cache_group: a KV-cache group the "
                               "router does not index, whose blocks are of another size; context_unknown: a CPU copy without "
                               "extra keys whose first blocks the worker never reported, so its salt or adapter is "
                               "unknown)", ["worker", "reason"],
                               registry=r)
        self.tokenizer_mismatch = Gauge("kvtier_router_worker_tokenizer_mismatch",
                                        "1 if the worker tokenized the router's check text differently from the "
                                        "router's --model-path tokenizer: no request can be keyed as its blocks are",
                                        ["worker"], registry=r)
        self.index_blocks = Gauge("kvtier_router_index_blocks", "Blocks in the router's index", registry=r)

    def forget_worker(self, url: str) -> None:
        """Drop a removed worker's present-state series (its counters stay: they are history)."""
        for gauge in (self.healthy, self.events_up, self.worker_blocks, self.prefill_speed, self.decode_step,
                      self.tokenizer_mismatch):
            try:
                gauge.remove(url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)

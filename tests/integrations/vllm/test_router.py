"""``kvtier route`` in front of two real vLLM workers (each with the kvtier connector, one shared
``kvtier serve``): sessions stick where their context is, a shared system prompt does not pin
traffic, a killed worker loses no request, a restarted worker's event publisher is re-synchronised,
streams pass through whole, errors are OpenAI's.

Everything is a real process on real sockets: the server, the two ``vllm serve`` workers
(started once for the module, one core each) publishing KV events over ZMQ, and the routers
(``python -m kvtier.cli.main route``). The restarted-publisher test runs second to last (it
restarts worker 1) and the killed-worker test last (worker 1 does not come back): in the other
order worker 1 was started again twice, ~30 s of start-up more.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import select
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(600)

TOKEN = "router-test-token"
MAX_MODEL_LEN = 16384
CHAT_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    from kvtier.bench.route_stack import kvtier_transfer_config, start_router, start_worker, wait_ready
    from kvtier.server.launch import ServerProcess

    logs = tmp_path_factory.mktemp("router-stack")
    server = ServerProcess.start({"acme": TOKEN})
    workers, routers = [], {}
    try:
        # kvtier's default 256-token blocks: the shared tier holds a context in those, a
        # worker's GPU in vLLM's 32-token pages.
        transfer = kvtier_transfer_config(server.url, TOKEN, block_tokens=256)
        template = logs / "chat-template.jinja"    # the tiny model has none; tools lead the prompt
        template.write_text(CHAT_TEMPLATE)
        # LoRA on, adapters loaded at run time (test_an_adapter_on_one_worker_…)
        lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
        # A context past the tiny model's 2,048 positions (its random weights do not care):
        # room for a generation long enough that a client leaving it is told from one decoded
        # whole before the abort came, on a CI machine that stalls for seconds (test_a_client_that_leaves_…)
        workers = [start_worker(tiny_model, logs / f"worker{i}.log", transfer=transfer, core=i % 2,
                                max_model_len=MAX_MODEL_LEN,
                                extra_args=["--chat-template", str(template), *lora],
                                env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                                     "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
                   for i in range(2)]
        wait_ready(workers)
        # The workers write through to the shared server: every block one computes, the other can load.
        for policy in ("tier-aware", "round-robin"):
            routers[policy] = start_router(tiny_model, workers, logs / f"router-{policy}.log", policy=policy,
                                           extra_args=["--shared-writes"])
        from kvtier.bench.route_stack import events_connected

        assert events_connected(routers["tier-aware"], 2), routers["tier-aware"].log_tail()
        yield {"model": tiny_model, "workers": workers, "routers": routers}
    finally:
        for p in [*routers.values(), *workers]:
            p.stop()
        server.stop()


def post(url: str, body, path: str = "/v1/completions", timeout: float = 120,
         headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), _body(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), _body(err.read())


def _body(raw: bytes) -> dict:
    """A JSON answer, or vLLM's plain-text ones (adapter loads) as ``{"text": …}``."""
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"text": raw.decode("utf-8", "replace")}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2048) for _ in range(n)]


def run_sessions(url: str, model: str, seed: int, sessions: int = 3, turns: int = 4) -> tuple[int, int, list]:
    """Conversations, one request at a time (turn 1 of every session, then turn 2 …): each
    turn's prompt is the previous prompt + the answer + a new user message. 3 sessions on
    2 workers: round-robin sends consecutive turns of a session to different workers."""
    rng = random.Random(seed)
    prompts = [tokens(rng, 288) for _ in range(sessions)]
    cached = total = 0
    where = []
    for turn in range(turns):
        for s in range(sessions):
            prompts[s] = prompts[s] + tokens(rng, 64)
            status, headers, out = post(url, {"model": model, "prompt": prompts[s], "max_tokens": 64,
                                              "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert status == 200, out
            prompts[s] = prompts[s] + out["choices"][0]["token_ids"]
            usage = out["usage"]
            assert usage["prompt_tokens"] == len(prompts[s]) - 64
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            total += usage["prompt_tokens"]
            where.append((s, turn, headers.get("X-Kvtier-Worker")))
        time.sleep(0.3)   # the workers' KV events reach the router
    return cached, total, where


def test_multi_turn_sessions_get_more_cached_tokens_than_round_robin(stack):
    model, routers = stack["model"], stack["routers"]
    rr_cached, rr_total, rr_where = run_sessions(routers["round-robin"].url, model, seed=1)
    ta_cached, ta_total, ta_where = run_sessions(routers["tier-aware"].url, model, seed=2)
    rr, ta = rr_cached / rr_total, ta_cached / ta_total
    print(f"cached-token ratio: tier-aware {ta:.3f}, round-robin {rr:.3f}")
    # round-robin moved sessions between workers: the shared tier gives the other worker
    # the context in whole 256-token blocks (the connector writes prompt and answer through) …
    assert len({w for s, _, w in rr_where if s == 0}) == 2
    # … tier-aware kept each session on the worker whose GPU holds all of it, page by page
    for s in range(3):
        assert len({w for t, _, w in ta_where if t == s}) == 1, ta_where
    assert ta > rr + 0.05, (ta, rr)


def test_a_shared_system_prompt_spreads_over_both_workers(stack):
    model, url = stack["model"], stack["routers"]["tier-aware"].url
    rng = random.Random(3)
    system = tokens(rng, 640)
    status, _, _ = post(url, {"model": model, "prompt": system + tokens(rng, 32), "max_tokens": 4})
    assert status == 200
    time.sleep(1.0)     # its blocks are indexed (and written through to the shared tier)
    bodies = [{"model": model, "prompt": system + tokens(rng, 64), "max_tokens": 32, "ignore_eos": True}
              for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: post(url, b), bodies))
    assert all(status == 200 for status, _, _ in answers)
    counts = {}
    for _, headers, _ in answers:
        counts[headers["X-Kvtier-Worker"]] = counts.get(headers["X-Kvtier-Worker"], 0) + 1
    print("system-prompt requests per worker:", counts)
    assert len(counts) == 2 and min(counts.values()) >= 2, counts


def test_streaming_passes_every_event_through(stack):
    model, url = stack["model"], stack["routers"]["tier-aware"].url
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"model": model, "prompt": tokens(random.Random(4), 200), "max_tokens": 48, "ignore_eos": True,
            "stream": True}
    sent = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and "text/event-stream" in resp.getheader("Content-Type")
    arrivals, done = [], False
    while True:
        line = resp.fp.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            arrivals.append(time.monotonic())
        elif line.startswith(b"data: [DONE]"):
            done = True
            break
    conn.close()
    # A stream of events through the router, not one reply. vLLM merges the outputs of steps its
    # HTTP layer has not sent yet, the more so the busier the machine (24+ on a quiet VM, 8 under a
    # loaded CI run), so the count asked is small.
    assert done and len(arrivals) >= 4
    # Arrival times are only reported: this tiny model decodes a token in ~2 ms and vLLM
    # often hands several steps' events to its HTTP layer at once, so their spacing here
    # says more about vLLM than about the router. That the router passes each chunk on as
    # it arrives is asserted against a worker that streams slowly, in
    # tests/router/test_http.py::test_streaming_passes_chunks_through_as_they_arrive.
    print(f"stream: {len(arrivals)} events in {len({round(t, 3) for t in arrivals})} arrivals over "
          f"{arrivals[-1] - arrivals[0]:.3f} s of {arrivals[-1] - sent:.3f} s")


def test_a_cache_salt_keys_a_tenants_prefix_apart(stack):
    """vLLM keys a request's blocks under its ``cache_salt`` (a tenant's), and so must the router:
    another salt, or none, must not be predicted to hit the first tenant's blocks."""
    model, url = stack["model"], stack["routers"]["tier-aware"].url
    prompt = tokens(random.Random(9), 600)

    def send(salt):
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        status, headers, out = post(url, body)
        assert status == 200, out
        return int(headers["X-Kvtier-Predicted-Cached"]), out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert send("tenant-a")[0] == 0
    time.sleep(1.0)     # its blocks' events reach the router
    predicted, cached = send("tenant-a")           # positive control: the same tenant hits
    assert predicted >= 512 and cached >= 512, (predicted, cached)
    for other in ("tenant-b", None):               # another tenant, and no salt: nothing to find
        assert send(other) == (0, 0), other
        time.sleep(0.5)


def test_an_agents_chat_with_tools_is_routed_to_its_context(stack):
    """vLLM renders tool definitions through its own schema (defaults filled in) before the
    template: the router's own rendering of the same request has other ids, so it asks a
    worker. Repeating the request must then be predicted where vLLM finds it cached."""
    from kvtier.router.requests import PromptTokenizer

    model, url = stack["model"], stack["routers"]["tier-aware"].url
    rng = random.Random(21)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {f"arg{j}": {"type": "string"} for j in range(6)}}}} for i in range(6)]
    body = {"model": model, "messages": [{"role": "system", "content": " ".join(map(str, tokens(rng, 200)))},
                                         {"role": "user", "content": "go"}],
            # tool_choice "none": vLLM still renders the tools ("auto" needs a tool-call parser)
            "tools": tools, "tool_choice": "none", "max_tokens": 4, "temperature": 0}
    # the positive control: the router's own rendering with the workers' template differs
    worker_ids = json.loads(urllib.request.urlopen(urllib.request.Request(
        stack["workers"][0].url + "/tokenize", data=json.dumps({k: body[k] for k in ("model", "messages", "tools")})
        .encode(), headers={"Content-Type": "application/json"})).read())["tokens"]
    local = PromptTokenizer(model)
    local.tok.chat_template = CHAT_TEMPLATE
    assert local.chat(body["messages"], body) != worker_ids
    status, _, out = post(url, body, "/v1/chat/completions")
    assert status == 200, out
    time.sleep(1.0)     # its blocks' events reach the router
    status, headers, out = post(url, body, "/v1/chat/completions")
    assert status == 200, out
    predicted, cached = int(headers["X-Kvtier-Predicted-Cached"]), out["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"chat with tools: {len(worker_ids)} prompt tokens, router predicted {predicted}, vLLM cached {cached}")
    assert out["usage"]["prompt_tokens"] == len(worker_ids)
    assert predicted >= 256 and cached >= 256 and abs(predicted - cached) < 256, (predicted, cached, len(worker_ids))


def test_unknown_or_malformed_requests_get_openai_errors(stack):
    url, model = stack["routers"]["tier-aware"].url, stack["model"]
    cases = [
        (b"{not json", "/v1/completions", 400),
        ({"model": model}, "/v1/completions", 400),                      # no prompt
        ({"model": model, "prompt": [1, -5]}, "/v1/completions", 400),   # token id out of range
        ({"model": model, "messages": "hi"}, "/v1/chat/completions", 400),
        ({"model": model, "prompt": "x"}, "/v1/nope", 404),
    ]
    for body, path, code in cases:
        status, headers, out = post(url, body, path)
        assert status == code, (path, body, status, out)
        assert set(out) == {"error"} and {"message", "type", "code"} <= set(out["error"]), out
        assert "Traceback" not in json.dumps(out)
    # A worker's own error (an unknown model) passes through in the same format, not as a 5xx
    status, _, out = post(url, {"model": "no-such-model", "prompt": "hello", "max_tokens": 2})
    assert 400 <= status < 500 and "error" in out, (status, out)


def _engine_metric(worker, name: str) -> float:
    """A vLLM worker's own Prometheus sample, summed over its label sets. Read line by line:
    prometheus_client's parser takes seconds over vLLM's histograms while the engines hold
    both cores, longer than the generation this is polled during."""
    with urllib.request.urlopen(worker.url + "/metrics", timeout=30) as resp:   # slow while it decodes
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))


def test_an_agent_on_the_anthropic_messages_api_is_routed_to_its_context(stack):
    """``/v1/messages`` (vLLM's Anthropic Messages API: Claude Code and other agents speak it)
    was a 404 at the router. It is keyed by the tokens a worker renders for it
    (``/v1/messages/render``), so a repeated long system prompt is predicted where vLLM finds
    it cached (Anthropic usage: ``cache_read_input_tokens``). Control: the first request is
    predicted to hit nothing. vLLM's tokenizer endpoints pass through unchanged."""
    model, url, workers = stack["model"], stack["routers"]["tier-aware"].url, stack["workers"]
    rng = random.Random(41)
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "system": " ".join(map(str, tokens(rng, 200))),
            "messages": [{"role": "user", "content": "go on"}]}
    status, headers, out = post(url, body, "/v1/messages")
    assert status == 200 and out["type"] == "message", out
    assert headers["X-Kvtier-Predicted-Cached"] == "0"        # control
    time.sleep(1.0)     # its blocks' events reach the router
    status, headers, out = post(url, body, "/v1/messages")
    assert status == 200, out
    predicted, cached = int(headers["X-Kvtier-Predicted-Cached"]), out["usage"].get("cache_read_input_tokens") or 0
    prompt = cached + out["usage"]["input_tokens"] + (out["usage"].get("cache_creation_input_tokens") or 0)
    print(f"messages API: {prompt} prompt tokens, router predicted {predicted}, vLLM cached {cached}")
    assert predicted >= 256 and cached >= 256 and abs(predicted - cached) < 256, (predicted, cached, prompt)
    # vLLM's tokenizer endpoints through the router: the worker's own answers
    direct = post(workers[0].url, {"model": model, "prompt": "hello there"}, "/tokenize")
    routed = post(url, {"model": model, "prompt": "hello there"}, "/tokenize")
    assert routed[0] == 200 and routed[2]["tokens"] == direct[2]["tokens"], (routed, direct)
    routed = post(url, {"model": model, "tokens": direct[2]["tokens"]}, "/detokenize")
    assert routed[0] == 200 and routed[2]["prompt"] == "hello there", routed


def _generated(workers) -> float:
    return sum(_engine_metric(w, "vllm:generation_tokens_total") for w in workers)


def _abort_results(router_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Every abort the router sent, by result (``ok``, ``refused``, ``failed``, ``again``), from
    its own Prometheus counter. (A CI run saw ``ok`` stay 0 for an abort that had cut its
    generation; the router then gave a worker 5 s to answer, now 30.)"""
    with urllib.request.urlopen(router_url + "/metrics", timeout=timeout_s) as resp:
        lines = resp.read().decode().splitlines()
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith("kvtier_router_worker_aborts_total{"):
            result = re.search(r'result="([^"]*)"', line).group(1)
            out[result] = out.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _aborts_sent(router_url: str, timeout_s: float = 10.0) -> float | None:
    """Aborts the router asked of its workers that they accepted (``ok``); None if the router
    did not answer within ``timeout_s``. Its /metrics is cheap, yet a CI run saw one wait past
    30 s while the engines held both cores, and fail the test there: a poll that goes
    unanswered is a poll to make again (:func:`_router_answer`)."""
    try:
        return _abort_results(router_url, timeout_s).get("ok", 0.0)
    except (TimeoutError, urllib.error.URLError) as exc:
        if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, TimeoutError):
            raise
        print(f"the router's /metrics did not answer in {timeout_s} s")
        return None


def _router_answer(router_url: str, timeout_s: float = 120.0) -> float:
    """:func:`_aborts_sent`, asked again until the router answers (at most ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (sent := _aborts_sent(router_url)) is None:
        assert time.monotonic() < deadline, f"the router's /metrics went unanswered for {timeout_s} s"
    return sent


def _leave_once(url: str, body: dict, workers) -> tuple[float, float]:
    """One client that leaves: a stream once the router's first event is in its socket, a whole
    answer after 0.5 s. Returns the tokens the workers decoded for it, and the aborts by name
    the router sent for it (accepted by the worker)."""
    before, aborts_before = _generated(workers), _router_answer(url)
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if body["stream"]:   # leave without reading it, as a client that gave up does
        assert select.select([conn.sock], [], [], 60)[0], "no first event in 60 s"
    else:
        time.sleep(0.5)
    conn.close()
    # The worker's /metrics only once the router's abort is through: while its engine decodes, a
    # worker's API server renders that answer on a core it shares with two busy processes, its
    # event loop held meanwhile. Polled at once, it held the abort back 31 s (12,949 tokens
    # decoded instead of ~260, in a probe of one worker here).
    _wait_for(lambda: (_aborts_sent(url) or 0) > aborts_before, timeout_s=60)
    assert _wait_for(lambda: sum(_engine_metric(w, "vllm:num_requests_running") for w in workers) == 0,
                     timeout_s=180)
    return _generated(workers) - before, _router_answer(url) - aborts_before


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_has_its_generation_aborted_on_the_worker(stack, stream):
    """A client that gives up: the router closes the worker's request and asks the worker to
    abort it by name (kvtier/router/abort.py), so vLLM stops decoding instead of going on to
    ``max_tokens`` for nobody. Closing alone was not enough: vLLM 0.32 may decode a non-streamed
    request whole after its connection closed (vllm-project/vllm#54947, 2 of 4 tries), and a CI
    run saw a stream decoded whole (1,900 of 1,900) because the worker's API server, short of
    CPU, sent its first event only at the end. Control: a request that stays gets all its tokens.

    The generation is 16,000 tokens (~43 s whole on an idle worker here), so that seconds of a
    stalled CI machine do not carry it past half: with 1,900 a CI run saw [1900, 1152, 1900]
    in three tries. At that length vLLM itself may notice a non-streamed client gone, late, so
    the router's abort by name is also checked on its own counter: sent, and accepted by the
    worker. Up to three tries, each depending on the worker's API server having CPU in time.
    The router's own part is checked without that race in tests/router/test_http.py; vLLM's
    naming of the ids the router aborts, with the client still there (only the abort can cut
    it), in the test below."""
    model, url, workers = stack["model"], stack["routers"]["tier-aware"].url, stack["workers"]
    rng = random.Random(12 + stream)
    long = MAX_MODEL_LEN - 384
    body = {"model": model, "prompt": tokens(rng, 64), "max_tokens": long, "ignore_eos": True, "stream": stream}
    status, _, out = post(url, {**body, "stream": False, "max_tokens": 400})   # control: stays, gets all
    assert status == 200 and out["usage"]["completion_tokens"] == 400
    tries, aborts = [], []
    for _ in range(3):
        decoded, sent = _leave_once(url, {**body, "prompt": tokens(rng, 64)}, workers)
        tries.append(decoded)
        aborts.append(sent)
        if 0 < decoded < long // 2:
            break
    print(f"tokens decoded for a client that left (stream={stream}), per try: {tries} of {long}; "
          f"aborts by name sent: {aborts}")
    assert 0 < tries[-1] < long // 2, tries
    assert aborts[-1] >= 1, (aborts, _abort_results(url))


def test_the_router_names_requests_as_vllm_does_so_that_they_can_be_aborted(stack):
    """The ids the router aborts (``engine_request_ids``) are the ones vLLM runs the request
    under, for a completion, a batch of prompts and a chat, through the router with the
    client's own ``X-Request-Id``; and the router's own ids reach vLLM (its answer's ``id``).
    The client stays connected: only an abort by the right name can end its generation early
    (finish_reason ``abort``). Control: the same abort sent under a wrong name changes nothing.
    Workers refuse aborts unless started with ``--enable-scale-out`` (kvtier's launchers do)."""
    from kvtier.router.abort import engine_request_ids

    model, url, workers = stack["model"], stack["routers"]["tier-aware"].url, stack["workers"]
    rng = random.Random(31)
    long = {"max_tokens": 1900, "ignore_eos": True}
    cases = [("/v1/completions", {"prompt": tokens(rng, 64)}),
             ("/v1/completions", {"prompt": [tokens(rng, 64), tokens(rng, 64)]}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 20}]}),
             ("/v1/completions", {"prompt": tokens(rng, 64), "wrong_name": True})]    # control
    for n, (path, extra) in enumerate(cases):
        wrong = extra.pop("wrong_name", False)
        body = {"model": model, **long, **extra}
        # An API server short of CPU may take the abort after the end, or (a chat, whose template the
        # API server renders first) before it has registered the request: a no-op. Each try waits
        # longer before aborting (a full fresh-clone CI run missed 3 tries of 0.5 s on the chat).
        for attempt, wait_s in enumerate((0.5, 1.5, 3.0, 3.0)):
            rid = f"kvtier-test-{n}-{attempt}"
            ids = engine_request_ids(path, rid + ("-x" if wrong else ""), body)
            result: dict = {}
            client = threading.Thread(target=lambda: result.update(
                answer=post(url, body, path, headers={"X-Request-Id": rid})))
            client.start()
            # once vLLM has it (an abort before that is a no-op: the next try). Not by polling
            # /metrics: while an engine decodes, that answer can take longer than the generation.
            time.sleep(wait_s)
            aborted = [post(w.url, {"request_ids": ids}, "/inference/v1/abort_requests")[0] for w in workers]
            client.join(120)
            status, _, out = result["answer"]
            assert status == 200 and aborted == [200, 200], (status, aborted, out)
            reasons = {c["finish_reason"] for c in out["choices"]}
            if wrong or reasons == {"abort"}:
                break
        assert out["id"].endswith(rid), out["id"]
        if wrong:
            assert reasons == {"length"} and out["usage"]["completion_tokens"] == 1900 * len(out["choices"])
        else:
            # (how early depends on when the metrics poll saw it run: the name is what is checked)
            assert reasons == {"abort"}, (path, out["choices"], out["usage"])
            assert out["usage"]["completion_tokens"] < 1900 * len(out["choices"]), out["usage"]
    # the router's own id, when the client gives none, reaches the worker
    status, headers, out = post(url, {"model": model, "prompt": tokens(rng, 8), "max_tokens": 1})
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]), headers
    assert out["id"] == "cmpl-" + headers["X-Request-Id"], (out["id"], headers)


def test_a_router_started_late_catches_up_from_the_workers_replay_buffers(stack, tmp_path):
    """A router that starts (or restarts) after its workers have served requests: it replays
    each worker's KV-event buffer (vLLM's ``replay_endpoint``) on connecting, so its index
    holds what the workers hold before any new event. Control: the router that listened all
    along holds the same blocks, and some."""
    from kvtier.bench.route_stack import start_router

    model, workers, live = stack["model"], stack["workers"], stack["routers"]["tier-aware"]
    status, _, _ = post(live.url, {"model": model, "prompt": tokens(random.Random(21), 300), "max_tokens": 1})
    assert status == 200
    time.sleep(0.5)
    held = [_indexed(live, w) for w in workers]
    assert sum(held) > 0
    late = start_router(model, workers, tmp_path / "late-router.log", policy="tier-aware",
                        extra_args=["--shared-writes"])
    try:
        assert _wait_for(lambda: [_indexed(late, w) for w in workers] == held, timeout_s=30), \
            ([_indexed(late, w) for w in workers], held, late.log_tail())
    finally:
        late.stop()


def test_a_responses_api_conversation_stays_on_the_worker_that_stored_it(stack):
    """vLLM keeps Responses API answers in the process that made them. Through round-robin,
    a conversation's next turn (``previous_response_id``) lands on the other worker half the
    time: a 404 there. The router sends each continuation to the worker that stored the
    response (before, it answered /v1/responses with a 404 of its own). Control: the first
    turns of the conversations spread over both workers."""
    model, url = stack["model"], stack["routers"]["round-robin"].url
    firsts = []
    for i in range(4):
        status, headers, out = post(url, {"model": model, "input": f"hello {i}", "max_output_tokens": 4},
                                    path="/v1/responses")
        assert status == 200 and out["id"].startswith("resp_"), out
        firsts.append((headers["X-Kvtier-Worker"], out["id"]))
    assert len({w for w, _ in firsts}) == 2
    for worker, rid in firsts:
        for _ in range(2):
            status, headers, out = post(url, {"model": model, "input": "go on", "previous_response_id": rid,
                                              "max_output_tokens": 4}, path="/v1/responses")
            assert status == 200 and headers["X-Kvtier-Worker"] == worker, (status, out)
            rid = out["id"]


def test_an_adapter_on_one_worker_is_routed_there_and_keyed_apart(stack, tmp_path):
    """A LoRA adapter loaded at run time on worker 1 only, behind the router's back: the router
    sent requests for it where load or cache said, and worker 0's vLLM answered 404 (4 of 8
    concurrent requests, measured). Now they go where the adapter is (its listing, or a
    worker's 404 for the name, which retries elsewhere). Through the router, an adapter loads
    on every worker. Its blocks are keyed apart from the base model's, as vLLM keys them: the
    router predicts its repeat prompt as a hit, and the base model's same tokens as none.
    Control: the base model's requests go to both workers."""
    from kvtier.integrations.transformers.models import random_lora_adapter

    model, workers = stack["model"], stack["workers"]
    rr, ta = stack["routers"]["round-robin"].url, stack["routers"]["tier-aware"].url
    adapter = random_lora_adapter(model, tmp_path / "adapter")
    status, _, _ = post(workers[1].url, {"lora_name": "only-w1", "lora_path": adapter}, path="/v1/load_lora_adapter")
    assert status == 200
    rng = random.Random(9)
    bodies = [{"model": name, "prompt": tokens(rng, 96), "max_tokens": 4} for name in ["only-w1"] * 6 + [model] * 6]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda b: post(rr, b), bodies))
    assert all(status == 200 for status, _, _ in answers), [out for _, _, out in answers]
    assert {h["X-Kvtier-Worker"] for _, h, _ in answers[:6]} == {workers[1].url}
    assert {h["X-Kvtier-Worker"] for _, h, _ in answers[6:]} == {w.url for w in workers}   # control
    with urllib.request.urlopen(rr + "/v1/models", timeout=30) as resp:
        assert {"only-w1", model} <= {m["id"] for m in json.loads(resp.read())["data"]}
    status, _, out = post(rr, {"lora_name": "everywhere", "lora_path": adapter}, path="/v1/load_lora_adapter")
    assert status == 200, out
    answers = [post(rr, {"model": "everywhere", "prompt": tokens(rng, 64), "max_tokens": 2}) for _ in range(4)]
    assert all(status == 200 for status, _, _ in answers)
    assert {h["X-Kvtier-Worker"] for _, h, _ in answers} == {w.url for w in workers}
    prompt = tokens(rng, 700)
    post(ta, {"model": "everywhere", "prompt": prompt, "max_tokens": 1})
    time.sleep(1.0)     # its blocks are indexed
    status, headers, out = post(ta, {"model": "everywhere", "prompt": prompt, "max_tokens": 1})
    assert status == 200 and int(headers["X-Kvtier-Predicted-Cached"]) >= 512
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
    status, headers, out = post(ta, {"model": model, "prompt": prompt, "max_tokens": 1})
    assert status == 200 and headers["X-Kvtier-Predicted-Cached"] == "0"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for w in workers:   # the later tests see no adapter
        for name in ("only-w1", "everywhere"):
            post(w.url, {"lora_name": name}, path="/v1/unload_lora_adapter")


def test_a_request_for_prompt_logprobs_is_predicted_to_hit_nothing_as_vllm_serves_it(stack):
    """vLLM reads no cached block for a request with prompt logprobs: the router predicts none
    (it predicted the prefix, and priced the request at a fraction of its prefill). Control: the
    same prompt without them is predicted and found cached."""
    model, url = stack["model"], stack["routers"]["tier-aware"].url
    prompt = tokens(random.Random(11), 700)
    assert post(url, {"model": model, "prompt": prompt, "max_tokens": 1})[0] == 200
    time.sleep(1.0)     # its blocks are indexed
    status, headers, out = post(url, {"model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200 and headers["X-Kvtier-Predicted-Cached"] == "0", headers
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(out["choices"][0]["prompt_logprobs"]) == len(prompt)
    status, headers, out = post(url, {"model": model, "prompt": prompt, "max_tokens": 1})   # control
    assert status == 200 and int(headers["X-Kvtier-Predicted-Cached"]) >= 512
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512


def test_a_truncated_prompt_is_predicted_as_vllm_runs_it(stack):
    """``truncate_prompt_tokens`` N: vLLM runs the last N tokens (or the first N with
    ``truncation_side: right``). The router keyed the whole prompt: a cached prefix that vLLM cut
    away was predicted as a hit. Each prediction here is checked against what vLLM found."""
    model, url = stack["model"], stack["routers"]["tier-aware"].url
    rng = random.Random(12)
    prompt, tail = tokens(rng, 700), tokens(rng, 100)
    assert post(url, {"model": model, "prompt": prompt, "max_tokens": 1})[0] == 200
    time.sleep(1.0)     # its blocks are indexed
    for extra, hit in (({"truncate_prompt_tokens": 100}, False),
                       ({"truncate_prompt_tokens": 700, "truncation_side": "right"}, True)):
        status, headers, out = post(url, {"model": model, "prompt": prompt + tail, "max_tokens": 1, **extra})
        assert status == 200, out
        predicted = int(headers["X-Kvtier-Predicted-Cached"])
        found = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (predicted >= 512 and found >= 512) if hit else (predicted == 0 and found == 0), (extra, predicted,
                                                                                                 found)


def test_the_routers_tokenizer_is_checked_against_each_workers(stack):
    """The router asks each worker how it tokenizes a check text (a worker serving another model
    would never be predicted a hit). With real vLLM serving the router's own model, both agree:
    no false alarm. The gauge is there (checked), not merely absent."""
    for router in stack["routers"].values():
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for w in stack["workers"]:
            assert f'kvtier_router_worker_tokenizer_mismatch{{worker="{w.url}"}} 0.0' in text, text[-2000:]


def _indexed(router, worker) -> float:
    from kvtier.bench.route_stack import router_metric

    return router_metric(router, "kvtier_router_worker_indexed_blocks", {"worker": worker.url})


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_a_restarted_event_publisher_is_resynchronised(stack):
    """Second to last in this module (the killed-worker test follows). Worker 1 restarts (a new
    vLLM process on the same URL and events endpoint: its publisher's sequence starts from 0
    and its cache is empty). The router must drop what the old process reported and rebuild
    worker 1's part of the index from the new one's events alone. Positive control: before the
    restart the index does hold worker 1's blocks, counted the same way, so a router that kept
    stale entries would fail below."""
    from kvtier.bench.route_stack import router_metric, wait_ready

    model, router, workers = stack["model"], stack["routers"]["tier-aware"], stack["workers"]
    w1 = workers[1]
    rng = random.Random(6)
    old, new = tokens(rng, 32 * 10 + 5), tokens(rng, 32 * 6 + 5)     # 10 and 6 whole vLLM pages
    if not w1.alive():          # run after the killed-worker test (-k, another order): bring it back first
        w1.restart()
        wait_ready([w1])
    assert _wait_for(lambda: router_metric(router, "kvtier_router_worker_events_up", {"worker": w1.url}) == 1)
    # Straight to worker 1 (not through the router): only its KV events tell the router.
    before = _indexed(router, w1)
    status, _, _ = post(w1.url, {"model": model, "prompt": old, "max_tokens": 1})
    assert status == 200
    assert _wait_for(lambda: _indexed(router, w1) >= before + 10), _indexed(router, w1)   # positive control
    resyncs = sum(router_metric(router, "kvtier_router_event_resyncs", {"worker": w1.url, "reason": r})
                  for r in ("disconnected", "restarted", "gap"))

    w1.kill()
    w1.restart()
    # while it is down its old entries are gone (a restarted engine holds none of them)
    assert _wait_for(lambda: _indexed(router, w1) == 0), _indexed(router, w1)
    wait_ready([w1])
    assert _wait_for(lambda: router_metric(router, "kvtier_router_worker_events_up", {"worker": w1.url}) == 1)
    after = sum(router_metric(router, "kvtier_router_event_resyncs", {"worker": w1.url, "reason": r})
                for r in ("disconnected", "restarted", "gap"))
    assert after > resyncs
    # the new publisher's events rebuild worker 1's entries: exactly its 6 new pages
    status, _, _ = post(w1.url, {"model": model, "prompt": new, "max_tokens": 1})
    assert status == 200
    assert _wait_for(lambda: _indexed(router, w1) == 6), _indexed(router, w1)
    time.sleep(1.0)
    assert _indexed(router, w1) == 6     # and nothing of the old process came back
    # the router routes on it again: out of approximate mode, worker 1 re-admitted
    assert _wait_for(lambda: router_metric(router, "kvtier_router_approximate_mode") == 0)
    assert _wait_for(lambda: router_metric(router, "kvtier_router_worker_healthy", {"worker": w1.url}) == 1)
    status, headers, out = post(router.url, {"model": model, "prompt": new + tokens(rng, 40), "max_tokens": 1})
    assert status == 200 and headers["X-Kvtier-Worker"] == w1.url, headers


def test_a_worker_killed_mid_run_loses_no_request(stack):
    """Last in this module: worker 1 (restarted by the test before) does not come back."""
    model, url, workers = stack["model"], stack["routers"]["tier-aware"].url, stack["workers"]
    rng = random.Random(5)
    bodies = [{"model": model, "prompt": tokens(rng, 300), "max_tokens": 48, "ignore_eos": True}
              for _ in range(12)]
    results = []

    def kill_soon():
        time.sleep(1.0)
        workers[1].kill()

    killer = threading.Thread(target=kill_soon)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, url, b) for b in bodies]
        killer.start()
        results = [f.result() for f in futures]
    killer.join()
    assert not workers[1].alive()
    for status, _, out in results:
        assert status == 200, out
        assert out["choices"][0]["text"] is not None and out["usage"]["completion_tokens"] == 48
    # … and afterwards every request goes to the survivor
    status, headers, _ = post(url, {"model": model, "prompt": tokens(rng, 100), "max_tokens": 4})
    assert status == 200 and headers["X-Kvtier-Worker"] == workers[0].url

"""The router's admin API: workers added, drained and removed while it runs (a planner's launcher).

Endpoints (JSON):

- ``GET /admin/workers`` — every worker: url, state (``serving`` / ``draining``), healthy,
  requests in flight, events connected.
- ``POST /admin/workers {"url", "events"?}`` — add a worker; it is routed to at once, so a
  launcher calls this only once the worker's ``/health`` answers. Adding a worker that is
  draining puts it back in rotation; adding one that serves changes nothing (200, not 201).
- ``POST /admin/workers/drain {"url"}`` — no new request goes to it; those in flight finish.
- ``DELETE /admin/workers {"url", "force"?}`` — forget a drained worker once nothing is in
  flight on it (409 otherwise, unless ``force`` is ``true``, a JSON boolean: the router stops
  counting its requests, and they still finish, but a whole answer whose first byte has not
  come ``request_timeout_s`` after the removal is seen is aborted there by name and sent to
  another worker). Its index entries and metric series go with it. The last healthy routable
  worker cannot be drained (the router would answer every request 503).

Who may call: with ``KVTIER_ROUTER_ADMIN_TOKEN`` set in the router's environment, a caller
presenting ``Authorization: Bearer <that token>`` (compared as SHA-256 digests in constant
time); without it, callers on loopback only (the router's default address), since adding
a worker points user traffic at an address of the caller's choosing. Loopback is not enough
alone: a web page open in a browser on the router's host is a loopback caller too (a
cross-site ``text/plain`` form post needs no CORS preflight; DNS rebinding names the page's
own host). So without a token a call is also refused if it carries an ``Origin`` header (a
browser's), a ``Host`` other than ``127.0.0.1``, ``[::1]`` or ``localhost`` (any port), or a
body that is not ``Content-Type: application/json`` (which a browser sends cross-site only
after a preflight, and the router answers none).

A wrong token is a failed login of the caller's address, as at the kvtier server: a token
bucket per address (:class:`kvtier.server.admission.LoginLimiter`, 10 at once, then one a
second), a warning logged for the first few of a burst, and an address over its budget is
answered 429 before its token is compared. (A local guesser can thus hold a loopback planner
off for a while; it cannot guess on.)

A worker added is priced at the median measured prefill speed of the others until its own
answers measure it. Worker ids are index bit positions: a removed worker's id is reused by the next one added,
after its index entries were cleared, so masks stay as narrow as the live pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
from typing import TYPE_CHECKING

from aiohttp import web

from kvtier.router.reads import body_too_late
from kvtier.router.requests import RequestError
from kvtier.router.workers import Worker
from kvtier.server.admission import LoginLimiter

if TYPE_CHECKING:
    from kvtier.router.app import Router

log = logging.getLogger(__name__)

TOKEN_ENV = "KVTIER_ROUTER_ADMIN_TOKEN"
#: the names a loopback caller may use for the router without a token (a browser's page after
#: DNS rebinding names its own host)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """``Host``'s name without its port: ``[::1]:8000`` → ``::1``, ``localhost:80`` → ``localhost``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _error(status: int, message: str) -> RequestError:
    """Raised; the router's error middleware answers it in the OpenAI error shape."""
    return RequestError(status, message, "admin_error")


def describe(w: Worker) -> dict:
    return {"url": w.url, "id": w.id, "state": "draining" if w.draining else "serving", "healthy": w.healthy,
            "inflight": w.inflight, "events": w.events_endpoint, "events_up": w.events_up,
            "models": sorted(w.models) if w.models is not None else None}


class WorkerAdmin:
    """Mutates ``router.workers`` (and its listeners, index and metrics) on the event loop only."""

    def __init__(self, router: "Router", token: str | None = None) -> None:
        self.router = router
        self._token = _digest(token) if token else None
        #: failed tokens per caller address (used on the event loop only)
        self.logins = LoginLimiter()

    def install(self, app: web.Application) -> None:
        app.router.add_get("/admin/workers", self.list_workers)
        app.router.add_post("/admin/workers", self.add_worker)
        app.router.add_post("/admin/workers/drain", self.drain_worker)
        app.router.add_delete("/admin/workers", self.remove_worker)

    # --- access ----------------------------------------------------------------------
    def _authorize(self, request: web.Request) -> None:
        if self._token is None:
            if not _loopback(request.remote):
                raise _error(403, f"admin API without {TOKEN_ENV} set: loopback callers only")
            if request.headers.get("Origin") is not None:
                raise _error(403, f"admin API without {TOKEN_ENV} set: no calls from a web page (an Origin header)")
            host = request.headers.get("Host")
            if host is not None and _host_name(host) not in LOOPBACK_HOSTS:
                raise _error(403, f"admin API without {TOKEN_ENV} set: call it as 127.0.0.1, [::1] or "
                                  f"localhost, not {host!r}")
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():   # no guess: nothing to charge
            raise _error(401, "admin API: missing or wrong bearer token")
        peer = request.remote or "?"
        if not self.logins.allowed(peer):
            raise _error(429, "admin API: too many wrong tokens from this address; retry later")
        if not hmac.compare_digest(_digest(token.strip()), self._token):
            if self.logins.failed(peer):   # a burst logs a few lines, not one per try
                log.warning("admin API: wrong bearer token from %s", peer)
            raise _error(401, "admin API: missing or wrong bearer token")

    async def _body(self, request: web.Request) -> dict:
        ctype = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if self._token is None and ctype != "application/json":
            raise _error(415, f"admin API without {TOKEN_ENV} set: send the body as Content-Type: application/json")
        try:
            body = await asyncio.wait_for(request.json(), self.router.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise body_too_late(self.router.config.body_timeout_s) from None
        except (ValueError, RecursionError):   # (a body nested too deeply is a RecursionError)
            raise _error(400, "the request body must be a JSON object") from None
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise _error(400, 'give {"url": "http://host:port"}')
        return body

    def _find(self, url: str) -> Worker | None:
        """The worker named ``url`` as :func:`normal_url` names it (``HTTP://Host:8000/`` is
        ``http://host:8000``): an add of a URL listed another way is that worker, never a second."""
        from kvtier.router.config import normal_url

        try:
            url = normal_url(url)
        except ValueError:   # (no worker has a URL that urlsplit cannot read)
            return None
        return next((w for w in self.router.workers if w.url == url), None)

    def _known(self, body: dict) -> Worker:
        worker = self._find(body["url"])
        if worker is None:
            raise _error(404, f"no worker {body['url']!r}")
        return worker

    # --- endpoints -------------------------------------------------------------------
    async def list_workers(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"workers": [describe(w) for w in self.router.workers]})

    async def add_worker(self, request: web.Request) -> web.Response:
        from kvtier.errors import ConfigError
        from kvtier.router.config import WorkerSpec

        self._authorize(request)
        body = await self._body(request)
        endpoints = {k: body.get(k) for k in ("events", "replay")}
        if any(v is not None and not isinstance(v, str) for v in endpoints.values()):
            raise _error(400, "events and replay are ZMQ endpoint strings")
        try:
            spec = WorkerSpec.parse(body["url"] + "".join(f",{k}={v}" for k, v in endpoints.items() if v))
        except ConfigError as exc:
            raise _error(400, str(exc)) from None
        known = self._find(spec.url)
        if known is not None:
            if known.draining:
                known.draining = False
                self.router._update_mode()   # its events count again for approximate mode
                log.info("worker %s back in rotation", known.url)
            return web.json_response(describe(known), status=200)
        used = {w.id for w in self.router.workers}
        wid = next(i for i in range(len(used) + 1) if i not in used)
        self.router.index.clear_worker(wid)     # nothing of an earlier holder of this id survives
        # Its backlog (pending tokens ÷ speed) is priced at the fleet's measured prefill speed
        # from the start: the router pools every worker's idle samples (Router.speed).
        worker = Worker(wid, spec.url, spec.events, spec.replay)
        self.router.workers.append(worker)
        self.router.metrics.healthy.labels(worker.url).set(1)
        self.router.metrics.events_up.labels(worker.url).set(0)
        if worker.events_endpoint:
            self.router.listen(worker)
        self.router._update_mode()
        self.router._refresh_models_soon()   # which models it serves (router/models.py)
        log.info("worker %s added (id %d)", worker.url, wid)
        return web.json_response(describe(worker), status=201)

    async def drain_worker(self, request: web.Request) -> web.Response:
        self._authorize(request)
        worker = self._known(await self._body(request))
        # Another worker must be left that is admitted (healthy) and not draining: draining the
        # last healthy one while its peer is ejected would leave the router nothing to serve with
        # (seen: a planner scaling an idle pool down drained the survivor of an OOM-killed peer).
        if not worker.draining and not any(w is not worker and not w.draining and w.healthy
                                           for w in self.router.workers):
            raise _error(409, f"{worker.url} is the last healthy routable worker; add another before draining it")
        worker.draining = True
        self.router.redecide_held(worker)   # what waits in the router for it goes elsewhere
        self.router._update_mode()   # its events no longer count for approximate mode
        log.info("worker %s draining (%d in flight)", worker.url, worker.inflight)
        return web.json_response(describe(worker))

    async def remove_worker(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self._body(request)
        # a JSON boolean only: read by truthiness, {"force": "false"} (a launcher's JSON built from
        # environment strings) forgot a worker with requests in flight (audit s34 a4 D4)
        force = body.get("force", False)
        if type(force) is not bool:
            raise _error(400, f'"force" must be true or false, got {force!r}')
        worker = self._known(body)
        if not worker.draining:
            raise _error(409, f"{worker.url} is serving: drain it first")
        if worker.inflight and not force:
            raise _error(409, f"{worker.url} has {worker.inflight} requests in flight; wait, or force")
        # Everything kept per id goes before the first await: once the worker is out of the
        # list an add may take its id (and, with the same URL, its metric series), and a cleanup
        # after the await wiped the newcomer's admission queue, index entries and blocks.
        self.router.workers.remove(worker)
        listeners = [x for x in self.router.listeners if x.worker is worker]
        for listener in listeners:
            self.router.listeners.remove(listener)
            listener.cancel()     # no event of the removed worker is applied after the cleanup
        self.router.index.clear_worker(worker.id)
        self.router.metrics.forget_worker(worker.url)
        # its admission queue goes too: a worker added later takes the freed id and must not
        # start with this one's tokens in flight (requests still sent keep their own reference;
        # those still held are decided again)
        self.router.redecide_held(worker)
        self.router.admission.pop(worker.id, None)
        self.router.approx.forget_worker(worker.id)   # nor the blocks the router's decisions sent it
        self.router._update_mode()
        for listener in listeners:
            await listener.stop()
        log.info("worker %s removed", worker.url)
        return web.json_response({**describe(worker), "state": "removed"})


def install(router: "Router", app: web.Application) -> WorkerAdmin:
    """The admin API on ``app``, with the token from the environment if one is set."""
    admin = WorkerAdmin(router, os.environ.get(TOKEN_ENV) or None)
    admin.install(app)
    return admin

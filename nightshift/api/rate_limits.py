"""Per-key and per-project rate limits, and fair admission at the door, as one plain ASGI
middleware in front of every /v1 route (health and metrics are not limited). The console's
requests (/console, api/console/) are held to the same limits and cap per console session (its
cookie stands for the key; its project is not known here, so only the session's own bucket), and
their database work queues as one: all open consoles together wait their turn for a database
slot like one key, however many there are.

Rate limits: a token bucket per API key (``rate_limit_key_rps``, ``rate_limit_key_burst``) and
per project (``rate_limit_project_rps``, ``..._burst``; 0 turns a limit off). A request over a
limit is answered 429 before any database work, held until its turn for a token would come
(at most ``rate_limit_hold_seconds``, so a client retrying at once is slowed to its limit), with
``Retry-After`` (seconds) and OpenAI's
rate-limit body (``type: "requests"``, ``code: "rate_limit_exceeded"``); every answer of a
limited key carries ``x-ratelimit-limit-requests`` (the bucket's size), ``x-ratelimit-
remaining-requests`` and ``x-ratelimit-reset-requests`` (until the bucket is full again, in
OpenAI's duration format: ``20ms``, ``1.5s``, ``1m30s``). The buckets live in Redis when the
service has one (``rate_limit_redis_url``, else the broker's when it is ``redis://``): one Lua
script per request checks both, so every API process shares the count; the embedded default
(no Redis, one API process) keeps them in process. If Redis cannot be reached the request is let
through (a limit is protection, not a reason to be down) and the fact logged once a minute.

Fair admission: at most ``api_key_inflight`` requests of one key are in a process at once
(running or waiting for a database slot, until their answer starts: a download streaming its
body holds no database slot and no longer counts); one more is answered 503 with ``Retry-After`` at
once, without being read, so a client hammering with many connections cannot fill the server's
queues, and every other key's request finds room. Inside, database work still waits at most
``api_queue_seconds`` for a slot (api/database.py), in a queue of its key's own: freed slots go
to the waiting keys in turn (api/fair_slots.py).

The key is known here by a hash of the bearer token (the token is never stored); its project by
``KeyProjects``, which the key lookup fills (api/deps.py): until a key's first request has been
looked up, only its own bucket is checked.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import orjson
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nightshift.api.anthropic.errors import anthropic_body, is_anthropic_path
from nightshift.api.fair_slots import REQUEST_KEY
from nightshift.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    name: str            # "key:<hash>" or "project:<id>"
    rate: float          # tokens a second
    burst: int           # the bucket's size


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limit: int                    # the tightest bucket's size
    remaining: int                # its tokens left after this request
    reset_seconds: float          # until it is full again
    retry_after: float            # (refused) until one token is back
    limited_by: Optional[str] = None
    rate: float = 0.0             # (refused) the limiting bucket's tokens a second


def _decide(states: list[tuple[Bucket, float]], allowed: bool) -> Decision:
    """From each bucket's tokens after the request (or before it, when refused)."""
    tightest, tokens = min(states, key=lambda st: st[1] / st[0].burst)
    reset = (tightest.burst - tokens) / tightest.rate
    if allowed:
        return Decision(True, tightest.burst, int(tokens), reset, 0.0)
    short = [(b, t) for b, t in states if t < 1]
    bucket, have = max(short, key=lambda st: (1 - st[1]) / st[0].rate)
    return Decision(False, bucket.burst, 0, (bucket.burst - have) / bucket.rate, (1 - have) / bucket.rate,
                    bucket.name, bucket.rate)


class LocalLimiter:
    """Token buckets in this process (the embedded default runs one API process)."""

    def __init__(self, max_buckets: int = 100_000):
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()   # name -> (tokens, at)
        self.max_buckets = max_buckets

    async def check(self, buckets: list[Bucket]) -> Decision:
        now = time.monotonic()
        with self._lock:
            states = []
            for bucket in buckets:
                tokens, at = self._buckets.get(bucket.name, (float(bucket.burst), now))
                states.append((bucket, min(float(bucket.burst), tokens + (now - at) * bucket.rate)))
            allowed = all(tokens >= 1 for _, tokens in states)
            if allowed:
                states = [(bucket, tokens - 1) for bucket, tokens in states]
            for bucket, tokens in states:
                self._buckets[bucket.name] = (tokens, now)
                self._buckets.move_to_end(bucket.name)
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        return _decide(states, allowed)


# KEYS: bucket names; ARGV: rate1, burst1, rate2, burst2, ... Takes a token from every bucket
# only if each has one. Time is the Redis server's, the same for every API host.
_LUA = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1000000
local tokens = {}
local allowed = 1
for i, key in ipairs(KEYS) do
  local rate, burst = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local state = redis.call('HMGET', key, 't', 'at')
  local t = tonumber(state[1]) or burst
  local at = tonumber(state[2]) or now
  t = math.min(burst, t + math.max(0, now - at) * rate)
  tokens[i] = t
  if t < 1 then allowed = 0 end
end
local out = {allowed}
for i, key in ipairs(KEYS) do
  local rate, burst = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local t = tokens[i]
  if allowed == 1 then t = t - 1 end
  redis.call('HSET', key, 't', t, 'at', now)
  redis.call('PEXPIRE', key, math.ceil((burst / rate) * 1000) + 1000)
  out[i + 1] = tostring(t)
end
return out
"""


class RedisLimiter:
    """Token buckets in Redis, shared by every API process (one round trip a request)."""

    PREFIX = "nightshift:ratelimit:"
    CONNECTIONS = 8                    # per API process

    def __init__(self, url: str):
        import redis.asyncio

        self.url = url
        self._clients: dict[int, object] = {}        # one client per event loop (uvicorn workers each have one)
        self._script_source = _LUA
        self._warned_at = -1e9
        self._redis = redis.asyncio

    def _client(self):  # noqa: ANN202
        import asyncio

        loop = id(asyncio.get_running_loop())
        pair = self._clients.get(loop)
        if pair is None:
            # a few connections, shared: a burst of requests waits its turn for one (a script call
            # is ~0.1 ms) instead of opening a connection each
            pool = self._redis.BlockingConnectionPool.from_url(self.url, max_connections=self.CONNECTIONS, timeout=0.5,
                                                               socket_timeout=0.5, socket_connect_timeout=0.5)
            client = self._redis.Redis(connection_pool=pool)
            pair = self._clients[loop] = (client, client.register_script(self._script_source))
        return pair

    async def check(self, buckets: list[Bucket]) -> Decision:
        _, script = self._client()
        args: list[float] = []
        for bucket in buckets:
            args += [bucket.rate, bucket.burst]
        try:
            result = await script(keys=[self.PREFIX + b.name for b in buckets], args=args)
        except Exception as exc:  # noqa: BLE001 - Redis away: let the request through
            now = time.monotonic()
            if now - self._warned_at >= 60:
                self._warned_at = now
                log.warning("rate limits not checked (Redis unreachable: %s); requests are let through", exc)
            return Decision(True, buckets[0].burst, buckets[0].burst, 0.0, 0.0)
        allowed = int(result[0]) == 1
        states = [(bucket, float(value)) for bucket, value in zip(buckets, result[1:])]
        return _decide(states, allowed)


class KeyProjects:
    """Key hash -> project id, filled by the key lookup; what names a request's project bucket
    before its key has been looked up again (a bounded LRU)."""

    def __init__(self, size: int = 100_000):
        self._map: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.size = size

    def get(self, key_hash: str) -> Optional[str]:
        return self._map.get(key_hash)

    def remember(self, key_hash: str, project_id: str) -> None:
        with self._lock:
            self._map[key_hash] = project_id
            self._map.move_to_end(key_hash)
            while len(self._map) > self.size:
                self._map.popitem(last=False)


def key_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset format: 20ms, 1.5s, 1m30s."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


def make_limiter(settings: Settings):  # noqa: ANN201 - LocalLimiter | RedisLimiter
    url = settings.rate_limit_redis_url
    if url is None and settings.resolved_broker_url.startswith(("redis://", "rediss://")):
        url = settings.resolved_broker_url
    return RedisLimiter(url) if url else LocalLimiter()


def _bearer(scope: Scope) -> Optional[str]:
    """The request's API key: a bearer token, else an ``x-api-key`` header (as api/deps.py reads it)."""
    api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token:
                return token
        elif name == b"x-api-key":
            api_key = value.decode("latin-1").strip() or None
    return api_key


CONSOLE_PATH, CONSOLE_STATIC = "/console/", "/console/static/"
CONSOLE_QUEUE = "console"          # the fair-slots key every console session's database work queues under


def _cookie(scope: Scope, name: str) -> Optional[str]:
    for header, value in scope["headers"]:
        if header == b"cookie":
            return cookie_parser(value.decode("latin-1")).get(name) or None
    return None


class RateLimits:
    """The middleware (module docstring). ``app.state.key_projects`` is the KeyProjects the key
    lookup fills; the limiter is made on the first request (in the serving event loop).
    ``console_cookie``: the console session cookie's name (api/console/sessions.py)."""

    def __init__(self, app: ASGIApp, settings: Settings, key_projects: KeyProjects,
                 console_cookie: Optional[str] = None):
        self.app = app
        self.settings = settings
        self.key_projects = key_projects
        self.console_cookie = console_cookie
        self.limiter = None
        self.inflight: dict[str, int] = {}
        self.held: dict[str, int] = {}           # refused requests of each key being held (_hold)
        self.limits_on = settings.rate_limit_key_rps > 0 or settings.rate_limit_project_rps > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        console = (self.console_cookie is not None and path.startswith(CONSOLE_PATH)
                   and not path.startswith(CONSOLE_STATIC))
        if console:
            session = _cookie(scope, self.console_cookie)
            token = f"console:{session}" if session else None
        else:
            token = _bearer(scope) if path.startswith("/v1/") else None
        if token is None:                      # not limited here (the route answers 401 / the login page)
            await self.app(scope, receive, send)
            return
        key = key_hash(token)
        decision = await self._check(key) if self.limits_on else None
        if decision is not None and not decision.allowed:
            await self._hold(key, decision)
            await _answer(send, 429, _shaped(scope, _rate_limited_body(decision, console), 429), _limit_headers(decision) + [
                (b"retry-after", str(max(1, math.ceil(decision.retry_after))).encode()),
                (b"retry-after-ms", str(max(1, math.ceil(decision.retry_after * 1000))).encode())])
            return
        # after the buckets: a request over the cap has spent its token, so a client that retries
        # 503s at once runs into its rate limit (and its held 429s) instead of spinning
        cap = self.settings.api_key_inflight
        if cap and self.inflight.get(key, 0) >= cap:
            await _answer(send, 503, _shaped(scope, _BUSY_BODY, 503), [(b"retry-after", str(self.settings.api_retry_after_seconds).encode())])
            return
        self.inflight[key] = self.inflight.get(key, 0) + 1
        extra = _limit_headers(decision) if decision is not None else []
        counted = True

        def leave() -> None:
            nonlocal counted
            if counted:
                counted = False
                left = self.inflight[key] - 1
                if left:
                    self.inflight[key] = left
                else:
                    del self.inflight[key]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                leave()                # a streamed body (a download) no longer counts against the cap
                if extra:
                    message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        whose = REQUEST_KEY.set(CONSOLE_QUEUE if console else key)   # slots shared out by key (api/fair_slots.py)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            REQUEST_KEY.reset(whose)
            leave()

    async def _hold(self, key: str, decision: Decision) -> None:
        """Keep a refused request until its turn for a token would come, behind the key's other
        held refusals, at most ``rate_limit_hold_seconds``: a client that ignores Retry-After and
        asks again at once, over many connections, is slowed to about its own limit, instead of
        taking the server's CPU from every other key with refusals (a held request costs nothing)."""
        held = self.held.get(key, 0)
        self.held[key] = held + 1
        try:
            await asyncio.sleep(min(self.settings.rate_limit_hold_seconds, decision.retry_after + held / decision.rate))
        finally:
            left = self.held[key] - 1
            if left:
                self.held[key] = left
            else:
                del self.held[key]

    async def _check(self, key: str) -> Decision:
        if self.limiter is None:
            self.limiter = make_limiter(self.settings)
        s = self.settings
        buckets = []
        if s.rate_limit_key_rps > 0:
            buckets.append(Bucket(f"key:{key}", s.rate_limit_key_rps, max(1, s.rate_limit_key_burst)))
        project = self.key_projects.get(key)
        if project is not None and s.rate_limit_project_rps > 0:
            buckets.append(Bucket(f"project:{project}", s.rate_limit_project_rps, max(1, s.rate_limit_project_burst)))
        if not buckets:
            return Decision(True, 0, 0, 0.0, 0.0)
        return await self.limiter.check(buckets)


def _limit_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    if not decision.limit:
        return []
    return [(b"x-ratelimit-limit-requests", str(decision.limit).encode()),
            (b"x-ratelimit-remaining-requests", str(decision.remaining).encode()),
            (b"x-ratelimit-reset-requests", duration(decision.reset_seconds).encode())]


def _rate_limited_body(decision: Decision, console: bool = False) -> bytes:
    which = "this project" if decision.limited_by and decision.limited_by.startswith("project:") else \
        "this console session" if console else "this API key"
    return orjson.dumps({"error": {
        "message": f"Rate limit reached for requests on {which}: limit {decision.limit} requests (refilled "
                   f"continuously). Please try again in {duration(decision.retry_after)}.",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}})


_BUSY_BODY = orjson.dumps({"error": {
    "message": "Too many requests of this API key are in progress at once; retry after a short wait.",
    "type": "server_error", "param": None, "code": "server_overloaded"}})


def _shaped(scope: Scope, body: bytes, status: int) -> bytes:
    """An OpenAI-shaped error body, in Anthropic's envelope on its paths (api/anthropic/errors.py)."""
    if not is_anthropic_path(scope["path"]):
        return body
    return orjson.dumps(anthropic_body(status, orjson.loads(body)["error"]["message"]))


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})

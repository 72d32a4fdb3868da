"""API load benchmark: polling clients, concurrent uploads and a large upload, against a
service this command starts itself while a batch runs on it.

  python -m bench.api_load [--shape embedded|services] [--clients 200] [--seconds 30]
                           [--interval 1.0] [--uploads 20] [--upload-lines 1000]
                           [--big-file-lines 50000] [--batch-requests 64]

Each polling client alternates ``GET /v1/batches/{id}`` and ``GET /v1/batches?limit=20``,
waiting ``--interval`` seconds between its polls (a dashboard polls about once a second;
``--interval 0`` polls back to back and measures the saturated server). The clients run in
several processes so the load generator is not the bottleneck. Prints, per kind of request:
count, requests/s, p50/p95/p99/max latency, 503s (with Retry-After) and errors (anything
else: timeouts, dropped connections, other statuses). Then the time from uploading a
``--big-file-lines`` file to its batch being ``in_progress``.

``--consoles N``: instead, measures what N open web consoles (/console, each logged in as a
browser does) cost the API: each console polls ``/console/api/progress`` for the running batch
every ``--console-interval`` seconds (the page's own interval by default), as its script does,
while the ``--clients`` poll the API as above. The API pollers run in windows without and with the
consoles, alternated ``--console-rounds`` times (so a drift of the machine or the batch falls on
both alike); prints each window's table and the p99 of ``GET /v1/batches/{id}`` without and with
the consoles, side by side.

``--hammer N``: instead, one key hammers ``GET /v1/batches/{id}`` back to back over N
connections while another key (another project) polls its own batch from ``--polite-clients``
clients once a second each; prints the polite key's latencies and errors (target: p99 < 50 ms,
0 errors) and what the hammering key got (200, 429 from its rate limit, 503 from its cap on
requests in flight).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import re
import resource
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import orjson

from bench.services import running_service
from nightshift.settings import Settings

CHAT = "/v1/chat/completions"


def request_lines(n: int, max_tokens: int, tag: str = "load", ignore_eos: bool = False) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT,
        "body": {"model": "default", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos,
                 "messages": [{"role": "system", "content": "You answer in one short sentence."},
                              {"role": "user", "content": f"Tell me a fact about the number {i}."}]}}) + b"\n"
        for i in range(n))


@dataclass
class Samples:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    overloaded: dict[str, int] = field(default_factory=dict)      # 503 with Retry-After
    errors: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, outcome: str) -> None:
        if outcome == "200":
            self.latencies.setdefault(kind, []).append(seconds)
        elif outcome == "503":
            self.overloaded[kind] = self.overloaded.get(kind, 0) + 1
        else:
            bucket = self.errors.setdefault(kind, {})
            bucket[outcome] = bucket.get(outcome, 0) + 1

    def merge(self, other: "Samples") -> None:
        for kind, values in other.latencies.items():
            self.latencies.setdefault(kind, []).extend(values)
        for kind, n in other.overloaded.items():
            self.overloaded[kind] = self.overloaded.get(kind, 0) + n
        for kind, bucket in other.errors.items():
            mine = self.errors.setdefault(kind, {})
            for outcome, n in bucket.items():
                mine[outcome] = mine.get(outcome, 0) + n


async def _timed(samples: Samples, kind: str, call) -> None:  # noqa: ANN001
    """Time one request; ``call()`` is an aiohttp request context (the body is read in full)."""
    started = time.perf_counter()
    try:
        async with call() as response:
            await response.read()
            retry_after = "retry-after" in response.headers
            outcome = "503" if response.status == 503 and retry_after else str(response.status)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome = type(exc).__name__
    samples.add(kind, time.perf_counter() - started, outcome)


def _session(key: str, connections: int) -> aiohttp.ClientSession:
    # aiohttp rather than httpx here: its client costs several times less CPU per request,
    # and the load generator shares the machine with the server it measures.
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"},
                                 timeout=aiohttp.ClientTimeout(total=30),
                                 connector=aiohttp.TCPConnector(limit=connections))


async def _poll(base_url: str, key: str, batch_id: str, clients: int, seconds: float, interval: float,
                offset: int) -> Samples:
    samples = Samples()
    async with _session(key, clients) as http:
        async def client(i: int) -> None:
            end = time.monotonic() + seconds
            get_batch = (i + offset) % 2 == 0
            await asyncio.sleep(interval * i / clients)      # spread the first polls over one interval
            while time.monotonic() < end:
                started = time.monotonic()
                if get_batch:
                    await _timed(samples, "GET /v1/batches/{id}", lambda: http.get(f"{base_url}/batches/{batch_id}"))
                else:
                    await _timed(samples, "GET /v1/batches?limit=20", lambda: http.get(f"{base_url}/batches?limit=20"))
                get_batch = not get_batch
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

        await asyncio.gather(*(client(i) for i in range(clients)))
    return samples


def _poll_process(args: tuple) -> Samples:
    return asyncio.run(_poll(*args))


async def _uploads(base_url: str, key: str, count: int, lines: int) -> Samples:
    samples = Samples()
    data = request_lines(lines, 16, "upload")

    def form(i: int) -> aiohttp.FormData:
        body = aiohttp.FormData()
        body.add_field("purpose", "batch")
        body.add_field("file", data, filename=f"u{i}.jsonl", content_type="application/jsonl")
        return body

    async with _session(key, count) as http:
        await asyncio.gather(*(_timed(samples, f"POST /v1/files ({lines} lines)",
                                      lambda i=i: http.post(f"{base_url}/files", data=form(i)))
                               for i in range(count)))
    return samples


async def _slow_readers(base_url: str, key: str, file_id: str, readers: int, seconds: float,
                        bytes_per_second: float) -> Samples:
    """``readers`` clients downloading one file at ``bytes_per_second`` each, again and again,
    for ``seconds``: what a slow network or a slow consumer does to the API. Each download is
    timed to its first byte (answering) and its outcome counted; the transfer itself is slow by
    design."""
    samples = Samples()
    kind = "GET /v1/files/{id}/content (slow)"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"},
                                     timeout=aiohttp.ClientTimeout(total=None, sock_read=60),
                                     connector=aiohttp.TCPConnector(limit=readers)) as http:
        async def reader() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                started = time.perf_counter()
                try:
                    async with http.get(f"{base_url}/files/{file_id}/content") as response:
                        first = None
                        async for chunk in response.content.iter_chunked(16384):
                            first = first or time.perf_counter() - started
                            await asyncio.sleep(len(chunk) / bytes_per_second)
                            if time.monotonic() > end:
                                break
                        samples.add(kind, first if first is not None else time.perf_counter() - started,
                                    str(response.status))
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    samples.add(kind, time.perf_counter() - started, type(exc).__name__)

        await asyncio.gather(*(reader() for _ in range(readers)))
    return samples


def _create_batch(http: httpx.Client, data: bytes, name: str) -> str:
    file_id = http.post("/files", data={"purpose": "batch"}, files={"file": (name, data)}).raise_for_status().json()["id"]
    return http.post("/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
                     ).raise_for_status().json()["id"]


def _wait_for_engine(http: httpx.Client, batch_id: str, timeout: float = 600) -> None:
    """Until the batch's first requests are answered: the engine is loaded and generating."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = http.get(f"/batches/{batch_id}").raise_for_status().json()
        if batch["request_counts"]["completed"] > 0 or batch["status"] not in ("validating", "in_progress"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} produced nothing in {timeout}s")


def _big_file_to_in_progress(http: httpx.Client, lines: int) -> tuple[float, float, str]:
    data = request_lines(lines, 16, "big")
    started = time.perf_counter()
    file_id = http.post("/files", data={"purpose": "batch"},
                        files={"file": ("big.jsonl", data)}).raise_for_status().json()["id"]
    uploaded = time.perf_counter() - started
    batch_id = http.post("/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
                         ).raise_for_status().json()["id"]
    while True:
        status = http.get(f"/batches/{batch_id}").raise_for_status().json()["status"]
        if status != "validating":
            break
        time.sleep(0.05)
    total = time.perf_counter() - started
    http.post(f"/batches/{batch_id}/cancel")           # the engine need not run it
    return uploaded, total, status, len(data)


GET_BATCH_ROUTE = ("GET", "/v1/batches/{batch_id}")


def server_buckets(base_url: str) -> dict[float, float]:
    """Cumulative counts of GET /v1/batches/{batch_id} by bucket bound, from the API's own
    latency histogram (``/metrics``, summed over its worker processes): the time inside the
    server, without the client's or the network's."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=60).raise_for_status().text
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "nightshift_http_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and (sample.labels["method"], sample.labels["route"]) == GET_BATCH_ROUTE:
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return counts


def server_latency_line(before: dict[float, float], after: dict[float, float]) -> str:
    """The server-side share within 50 ms and the bucket the p99 falls in, for the window."""
    delta = {bound: after.get(bound, 0.0) - before.get(bound, 0.0) for bound in after}
    total = delta.get(float("inf"), 0.0)
    if not total:
        return "server side (the API's /metrics): no GET batch requests timed"
    p99 = min(bound for bound, n in delta.items() if n >= 0.99 * total)
    within = delta.get(0.05, 0.0) / total * 100
    return (f"server side (the API's /metrics histogram): {int(total)} GET batch, {within:.2f}% answered within "
            f"50 ms, p99 <= {p99 * 1000:g} ms")


ROLES = (("uvicorn", "API"), ("nightshift.api.cli serve", "API"), ("-Q gpu", "engine worker"),
         ("celery", "cpu worker + beat"), ("postgres", "Postgres"), ("redis-server", "Redis"), ("moto", "S3 (moto)"))


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of every process on the machine, by role: the
    service's processes (a process counts under its nearest ancestor whose command line names a
    role), the load generator (this process and its client processes, once they have exited),
    everything else."""
    import psutil

    me = os.getpid()
    totals: dict[str, float] = {}
    for proc in psutil.process_iter():
        try:
            times = proc.cpu_times()
            chain = [proc, *proc.parents()]
            role = None
            for p in chain:
                line = " ".join(p.cmdline())
                role = next((name for key, name in ROLES if key in line), None)
                if role or p.pid == me:
                    break
            if role is None and any(p.pid == me for p in chain):
                continue   # the load generator's pool: counted below, from its reaped children
            role = role or "other"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    totals["load generator"] = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return totals


def cpu_line(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    used = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    parts = ", ".join(f"{role} {n:.1f}" for role, n in sorted(used.items(), key=lambda kv: -kv[1]) if n >= 0.05)
    return (f"CPU seconds in the window ({os.cpu_count()} cores x {seconds:.0f} s = {os.cpu_count() * seconds:.0f}): "
            f"{parts}")


def _ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def report(samples: Samples, seconds: float) -> str:
    kinds = sorted(set(samples.latencies) | set(samples.overloaded) | set(samples.errors))
    rows = [f"{'request':34} {'ok':>7} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8} "
            f"{'503':>6} errors"]
    for kind in kinds:
        lat = samples.latencies.get(kind, [])
        rate = len(lat) / seconds if not kind.startswith("POST") else float("nan")
        errors = samples.errors.get(kind, {})
        rows.append(f"{kind:34} {len(lat):7d} {rate:8.1f} {_ms(lat, .5):8.1f} {_ms(lat, .95):8.1f} "
                    f"{_ms(lat, .99):8.1f} {max(lat, default=float('nan')) * 1000:8.1f} "
                    f"{samples.overloaded.get(kind, 0):6d} {sum(errors.values())} {errors or ''}")
    return "\n".join(rows)


async def _hammer(base_url: str, key: str, batch_id: str, connections: int, seconds: float) -> dict[str, int]:
    """``connections`` clients requesting back to back, each answer counted by status."""
    statuses: dict[str, int] = {}
    async with _session(key, connections) as http:
        async def client() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                try:
                    async with http.get(f"{base_url}/batches/{batch_id}") as response:
                        await response.read()
                        outcome = str(response.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    outcome = type(exc).__name__
                statuses[outcome] = statuses.get(outcome, 0) + 1

        await asyncio.gather(*(client() for _ in range(connections)))
    return statuses


def _hammer_process(args: tuple) -> dict[str, int]:
    return asyncio.run(_hammer(*args))


def _new_key(service, project: str) -> str:  # noqa: ANN001 - a RunningService
    from nightshift.jobs.projects.api_keys import create_key
    from nightshift.storage.db import session_scope

    url = service.database_url or f"sqlite:///{(service.home / 'nightshift.db').resolve()}"
    with session_scope(url) as s:
        return create_key(s, project)[1]


def hammer_run(args: argparse.Namespace) -> Samples:
    """One key hammering, another polling politely (module docstring)."""
    with running_service(args.shape) as service:
        hammer_http = httpx.Client(base_url=service.base_url, timeout=600,
                                   headers={"Authorization": f"Bearer {service.api_key}"})
        polite_key = _new_key(service, "polite")
        polite_http = httpx.Client(base_url=service.base_url, timeout=600,
                                   headers={"Authorization": f"Bearer {polite_key}"})
        hammered = _create_batch(hammer_http, request_lines(4, 8), "hammered.jsonl")
        polled = _create_batch(polite_http, request_lines(4, 8), "polled.jsonl")
        for http, batch_id in ((hammer_http, hammered), (polite_http, polled)):   # polled, not run
            http.post(f"/batches/{batch_id}/cancel").raise_for_status()
        print(f"service: {args.shape} at {service.base_url}; one key hammers with {args.hammer} connections, "
              f"another polls from {args.polite_clients} clients once a second, for {args.seconds:.0f}s", flush=True)
        processes = max(1, min(args.processes, args.hammer))
        shares = [args.hammer // processes + (i < args.hammer % processes) for i in range(processes)]
        cpu_before = cpu_by_role()
        started = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(processes + 1) as pool:
            polite = pool.submit(_poll_process, (service.base_url, polite_key, polled, args.polite_clients,
                                                 args.seconds, 1.0, 0))
            hammers = [pool.submit(_hammer_process, (service.base_url, service.api_key, hammered, n, args.seconds))
                       for n in shares]
            samples = polite.result()
            statuses: dict[str, int] = {}
            for hammer in hammers:
                for outcome, n in hammer.result().items():
                    statuses[outcome] = statuses.get(outcome, 0) + n
        elapsed = time.perf_counter() - started
        cpu_after = cpu_by_role()
        print(report(samples, elapsed))
        latencies = [x for values in samples.latencies.values() for x in values]
        errors = sum(sum(b.values()) for b in samples.errors.values()) + sum(samples.overloaded.values())
        print(f"target: the polite key 0 errors, p99 < 50 ms -> {errors} errors or 503s, p99 {_ms(latencies, .99):.1f} ms "
              f"over {len(latencies)} polls")
        answered = sum(statuses.values())
        print(f"the hammering key: {answered} answers ({answered / elapsed:.0f}/s): "
              + ", ".join(f"{n} x {k}" for k, n in sorted(statuses.items())))
        print(cpu_line(cpu_before, cpu_after, elapsed))
        return samples


CONSOLE_POLL = "GET /console/api/progress"
CONSOLE_INTERVAL = Settings.model_fields["console_poll_seconds"].default   # the page's own


def console_logins(root: str, key: str, count: int) -> list[str]:
    """``count`` console sessions of ``key``, each logged in as a browser does (the login form,
    then the key posted with the form's token): their session cookies."""
    tokens = []
    for _ in range(count):
        with httpx.Client(base_url=root, timeout=60) as browser:
            form = browser.get("/console/login").raise_for_status()
            login_token = re.search(r'name="login_token" value="([^"]+)"', form.text)[1]
            answer = browser.post("/console/login", data={"api_key": key, "login_token": login_token})
            if answer.status_code != 303:
                raise RuntimeError(f"console login answered {answer.status_code}: {answer.text[:300]}")
            tokens.append(answer.cookies["nightshift_console"])
    return tokens


async def _consoles(root: str, tokens: list[str], batch_ids: list[str], seconds: float, interval: float) -> Samples:
    """One open console per token, each polling its batches' progress every ``interval`` seconds
    (after its previous answer, as the page's script does; their first polls spread over one interval)."""
    samples = Samples()
    url = f"{root}/console/api/progress?ids={','.join(batch_ids)}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), cookie_jar=aiohttp.DummyCookieJar(),
                                     connector=aiohttp.TCPConnector(limit=len(tokens))) as http:
        async def console(i: int, token: str) -> None:
            headers = {"Cookie": f"nightshift_console={token}", "Accept": "application/json"}
            end = time.monotonic() + seconds
            await asyncio.sleep(interval * i / len(tokens))
            while time.monotonic() < end:
                started = time.monotonic()
                await _timed(samples, CONSOLE_POLL, lambda: http.get(url, headers=headers))
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

        await asyncio.gather(*(console(i, token) for i, token in enumerate(tokens)))
    return samples


def _consoles_process(args: tuple) -> Samples:
    return asyncio.run(_consoles(*args))


def _client_and_batch(service, batch_requests: int) -> tuple[httpx.Client, str]:
    """A client of the service's API key and the batch that runs during the load: once the engine
    has started on it (``batch_requests`` lines), or created and cancelled when there are none."""
    http = httpx.Client(base_url=service.base_url, headers={"Authorization": f"Bearer {service.api_key}"},
                        timeout=600)
    batch_id = _create_batch(http, request_lines(max(1, batch_requests), 128, ignore_eos=True), "running.jsonl")
    if batch_requests:
        _wait_for_engine(http, batch_id)
    else:
        http.post(f"/batches/{batch_id}/cancel").raise_for_status()
    return http, batch_id


def consoles_run(args: argparse.Namespace) -> dict[str, Samples]:
    """The API's pollers without and with ``--consoles`` open consoles (module docstring)."""
    with running_service(args.shape) as service:
        http, batch_id = _client_and_batch(service, args.batch_requests)
        root = service.base_url.removesuffix("/v1")
        tokens = console_logins(root, service.api_key, args.consoles)
        print(f"service: {args.shape} at {service.base_url}; batch {batch_id} ({args.batch_requests} requests) running; "
              f"{args.clients} API clients poll every {args.interval}s; {args.consoles} consoles logged in, each "
              f"polling every {args.console_interval}s; {args.console_rounds} rounds of {args.seconds:.0f}s without "
              f"and {args.seconds:.0f}s with them", flush=True)
        processes = max(1, min(args.processes, args.clients))
        shares = [args.clients // processes + (i < args.clients % processes) for i in range(processes)]
        windows = {"without": Samples(), "with": Samples()}
        elapsed = dict.fromkeys(windows, 0.0)
        buckets = {name: {} for name in windows}
        cpu = {name: {} for name in windows}
        for _ in range(args.console_rounds):
            for name in windows:
                buckets_before, cpu_before = server_buckets(service.base_url), cpu_by_role()
                started = time.perf_counter()
                with concurrent.futures.ProcessPoolExecutor(processes + 1) as pool:
                    polls = [pool.submit(_poll_process, (service.base_url, service.api_key, batch_id, n, args.seconds,
                                                         args.interval, i)) for i, n in enumerate(shares)]
                    if name == "with":
                        polls.append(pool.submit(_consoles_process, (root, tokens, [batch_id], args.seconds,
                                                                     args.console_interval)))
                    for poll in polls:
                        windows[name].merge(poll.result())
                elapsed[name] += time.perf_counter() - started
                _add(buckets[name], buckets_before, server_buckets(service.base_url))
                _add(cpu[name], cpu_before, cpu_by_role())
        batch = http.get(f"/batches/{batch_id}").json()
        p99 = {}
        for name, samples in windows.items():
            print(f"\n{name} consoles ({elapsed[name]:.0f}s):")
            print(report(samples, elapsed[name]))
            print(server_latency_line({}, buckets[name]))
            print(cpu_line({}, cpu[name], elapsed[name]))
            p99[name] = _ms(samples.latencies.get("GET /v1/batches/{id}", []), .99)
        errors = sum(sum(b.values()) for w in windows.values() for b in w.errors.values())
        print(f"\nbatch {batch['status']}, {batch['request_counts']['completed']}/{batch['request_counts']['total']} "
              f"done at the end")
        print(f"GET /v1/batches/{{id}} p99: {p99['without']:.1f} ms without consoles, {p99['with']:.1f} ms with "
              f"{args.consoles} consoles polling every {args.console_interval}s; errors {errors}")
        http.post(f"/batches/{batch_id}/cancel")
        return windows


def _add(total: dict, before: dict, after: dict) -> None:
    """Add one window's growth of cumulative counts (histogram buckets, CPU seconds) to ``total``."""
    for name, value in after.items():
        total[name] = total.get(name, 0.0) + value - before.get(name, 0.0)


def run(args: argparse.Namespace) -> Samples | dict[str, Samples]:
    if args.hammer:
        return hammer_run(args)
    if args.consoles:
        return consoles_run(args)
    with running_service(args.shape) as service:
        http, batch_id = _client_and_batch(service, args.batch_requests)
        print(f"service: {args.shape} at {service.base_url}; batch {batch_id} ({args.batch_requests} requests) "
              f"running during the load", flush=True)
        processes = max(1, min(args.processes, args.clients))
        shares = [args.clients // processes + (i < args.clients % processes) for i in range(processes)]
        samples = Samples()
        readers = None
        if args.slow_readers:
            line = orjson.dumps({"custom_id": "d", "method": "POST", "url": CHAT, "body": {
                "model": "default", "messages": [{"role": "user", "content": "x" * 1000}]}}) + b"\n"
            big = line * max(1, int(args.reader_file_mb * 1e6 / len(line)))
            file_id = http.post("/files", data={"purpose": "batch"},
                                files={"file": ("download.jsonl", big)}).raise_for_status().json()["id"]
            readers = concurrent.futures.ThreadPoolExecutor(1).submit(
                asyncio.run, _slow_readers(service.base_url, service.api_key, file_id, args.slow_readers,
                                           args.seconds, args.reader_kbps * 1000))
            print(f"{args.slow_readers} slow readers of a {len(big) / 1e6:.1f} MB file at {args.reader_kbps} kB/s each",
                  flush=True)
        buckets_before, cpu_before = server_buckets(service.base_url), cpu_by_role()
        started = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(processes) as pool:
            polls = [pool.submit(_poll_process, (service.base_url, service.api_key, batch_id, n, args.seconds,
                                                 args.interval, i)) for i, n in enumerate(shares)]
            if args.uploads:
                samples.merge(asyncio.run(_uploads(service.base_url, service.api_key, args.uploads,
                                                   args.upload_lines)))
            for poll in polls:
                samples.merge(poll.result())
        if readers is not None:
            samples.merge(readers.result())
        elapsed = time.perf_counter() - started
        cpu_after, buckets_after = cpu_by_role(), server_buckets(service.base_url)
        batch = http.get(f"/batches/{batch_id}").json()
        print(f"\n{args.clients} polling clients (interval {args.interval}s) for {args.seconds:.0f}s, "
              f"{args.uploads} concurrent uploads; batch {batch['status']}, "
              f"{batch['request_counts']['completed']}/{batch['request_counts']['total']} done, "
              f"{batch['usage']['output_tokens']} tokens generated")
        print(report(samples, elapsed))
        get_batch = samples.latencies.get("GET /v1/batches/{id}", [])
        errors = sum(sum(b.values()) for b in samples.errors.values())
        print(f"target: 0 errors, p99 of GET batch < 50 ms -> errors {errors}, p99 {_ms(get_batch, .99):.1f} ms")
        print(server_latency_line(buckets_before, buckets_after))
        print(cpu_line(cpu_before, cpu_after, elapsed))
        if args.big_file_lines:
            uploaded, total, status, size = _big_file_to_in_progress(http, args.big_file_lines)
            print(f"{args.big_file_lines:,}-line file ({size / 1e6:.1f} MB): uploaded in {uploaded:.2f}s, batch {status} "
                  f"{total:.2f}s after the upload began")
        http.post(f"/batches/{batch_id}/cancel")
        return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.api_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["embedded", "services"], default="embedded")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between a client's polls")
    parser.add_argument("--uploads", type=int, default=20)
    parser.add_argument("--upload-lines", type=int, default=1000)
    parser.add_argument("--slow-readers", type=int, default=0,
                        help="clients downloading a large file slowly during the load (0: none)")
    parser.add_argument("--reader-kbps", type=float, default=320, help="each slow reader's rate, kB/s")
    parser.add_argument("--reader-file-mb", type=float, default=19.5, help="size of the file the slow readers fetch")
    parser.add_argument("--big-file-lines", type=int, default=50_000)
    parser.add_argument("--batch-requests", type=int, default=256, help="0: no batch runs during the load")
    parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="load-generator processes")
    parser.add_argument("--hammer", type=int, default=0,
                        help="connections of one key requesting back to back, beside a polite key (0: off)")
    parser.add_argument("--polite-clients", type=int, default=10, help="--hammer: the polite key's clients")
    parser.add_argument("--consoles", type=int, default=0,
                        help="open web consoles polling their batch's progress, in windows beside ones without (0: off)")
    parser.add_argument("--console-interval", type=float, default=CONSOLE_INTERVAL,
                        help="--consoles: seconds between a console's polls (default: the page's own)")
    parser.add_argument("--console-rounds", type=int, default=2,
                        help="--consoles: windows without and with the consoles, alternated this many times")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()

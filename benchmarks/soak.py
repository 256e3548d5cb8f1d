"""Soak: many requests, with clients that misbehave, against one server; then checks that nothing
leaked or hung and that resident memory stayed flat.

    python benchmarks/soak.py                          # the default model, 10,000 requests
    python benchmarks/soak.py --tiny-model DIR         # the tiny random test model, built in DIR
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid PID   # a running server

Without ``--url`` the script starts ``splitfuse serve`` in a subprocess on a free port (so that its
resident memory is the server's alone) and stops it at the end. Each request is drawn, with a
fixed seed, from:

    complete, chat              non-streaming, read to the end (200)
    complete_stream, chat_stream    streamed to ``data: [DONE]`` (200)
    stream_disconnect           streamed, the connection closed after 0-8 lines
    abort                       non-streaming, long, the connection closed after 0.05-1 s
    invalid                     a malformed or refused body (4xx)

``--warmup`` requests of the same mix run first; the server's RSS (``VmRSS`` of
``/proc/PID/status``) is read after them and again once the last request ended and the server
settled. Then ``/metrics`` must show no running or waiting request and no KV block in use.

Exit code 1 when a request hung (no answer within ``--request-timeout``), a request was left
running or waiting, a KV block stayed in use, an answer was a 5xx or not the status its body calls
for, or RSS grew by more than ``--max-rss-growth-mib``; 0 otherwise.

The server inherits the environment: ``LRU_CACHE_CAPACITY=16 ONEDNN_PRIMITIVE_CACHE_CAPACITY=16``
caps oneDNN's caches of one kernel per matrix-product shape (1,024 entries each by default), which
otherwise grow resident memory until they are full.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent

KINDS = {  # kind -> weight
    "complete": 3,
    "complete_stream": 3,
    "chat": 2,
    "chat_stream": 2,
    "stream_disconnect": 4,
    "abort": 3,
    "invalid": 3,
}
_TEXT = (
    "the city river boat harbour paris france capital light sound water sun moon cache "
    "serving request block token stream batch prefix story keeper storm whale evening"
)
_WORDS = _TEXT.split()
# A long shared opening: requests that start with it share prefix-cached blocks.
_SHARED_PREFIX = " ".join(_WORDS * 3)


@dataclass(frozen=True)
class Outcome:
    kind: str
    status: int | None  # None: the client left before the status line, or nothing came back
    disconnected: bool = False  # the client closed the connection before the answer's end
    hung: bool = False  # no answer within the request timeout
    unexpected: bool = False  # a status other than the one the body calls for


@dataclass
class SoakReport:
    num_requests: int = 0
    duration_s: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    num_disconnects: int = 0
    num_hung: int = 0
    num_unexpected: int = 0
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    leaked_blocks: int | None = None  # None: the block count is not known
    rss_before_mib: float | None = None  # None: the server's pid is not known
    rss_after_mib: float | None = None
    rss_samples_mib: list[float] = field(default_factory=list)

    @property
    def rss_growth_mib(self) -> float | None:
        if self.rss_before_mib is None or self.rss_after_mib is None:
            return None
        return self.rss_after_mib - self.rss_before_mib

    @property
    def num_5xx(self) -> int:
        return sum(count for status, count in self.statuses.items() if status.startswith("5"))

    def problems(self, max_rss_growth_mib: float) -> list[str]:
        """What fails the soak; [] when it passed."""
        problems = []
        if self.num_hung:
            problems.append(f"{self.num_hung} requests hung")
        if self.num_running or self.num_waiting:
            problems.append(f"{self.num_running:.0f} running, {self.num_waiting:.0f} waiting left")
        if self.kv_cache_usage > 0:
            problems.append(f"KV blocks still in use (usage {self.kv_cache_usage:.6f})")
        if self.num_5xx:
            problems.append(f"{self.num_5xx} answers were 5xx")
        if self.num_unexpected:
            problems.append(f"{self.num_unexpected} answers had an unexpected status")
        growth = self.rss_growth_mib
        if growth is not None and growth > max_rss_growth_mib:
            problems.append(f"RSS grew by {growth:.0f} MiB (bound {max_rss_growth_mib:.0f})")
        return problems

    def format(self) -> str:
        def mib(value: float | None) -> str:
            return "n/a" if value is None else f"{value:,.0f} MiB"

        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items()))
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.kinds.items()))
        leaked = "n/a" if self.leaked_blocks is None else str(self.leaked_blocks)
        growth = self.rss_growth_mib
        return "\n".join(
            [
                f"requests        {self.num_requests:,} in {self.duration_s:.1f} s "
                f"({self.num_requests / max(self.duration_s, 1e-9):.1f} req/s)",
                f"kinds           {kinds}",
                f"disconnects     {self.num_disconnects:,} (the client closed the connection "
                "before the answer's end)",
                f"statuses        {statuses} (none: the client left before the status line)",
                f"unexpected      {self.num_unexpected}",
                f"hung            {self.num_hung}",
                f"left over       {self.num_running:.0f} running, {self.num_waiting:.0f} waiting, "
                f"KV usage {self.kv_cache_usage:.6f}, leaked blocks {leaked}",
                f"RSS             {mib(self.rss_before_mib)} -> {mib(self.rss_after_mib)} "
                f"(growth {'n/a' if growth is None else f'{growth:+,.0f} MiB'}); "
                f"samples {', '.join(f'{s:,.0f}' for s in self.rss_samples_mib)}",
            ]
        )


# -- the server ---------------------------------------------------------------------------


def resident_mib(pid: int) -> float:
    """Resident memory of process ``pid`` (MiB), from ``VmRSS`` in /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


@dataclass(frozen=True)
class StartedServer:
    url: str
    pid: int
    num_kv_blocks: int
    log_path: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(
    model: str | None, serve_args: list[str], log_path: Path, timeout: float = 900.0
) -> Iterator[StartedServer]:
    """``splitfuse serve [model] serve_args`` in a subprocess on a free loopback port; yields once
    it is ready and its step graphs are compiled (or not used), then stops it (SIGTERM)."""
    port = _free_port()
    command = [
        sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
        "serve", *([model] if model else []), "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "info", *serve_args,
    ]  # fmt: skip
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            deadline = time.monotonic() + timeout
            while True:
                log = log_path.read_text()
                ready = re.search(r"engine ready in .* num_kv_blocks=(\d+)", log)
                compiled = "--no-compile" in serve_args or re.search(
                    r"compile: (step graphs ready|not used|the step graphs failed)", log
                )
                if ready and compiled:
                    break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start; its log:\n{log[-4000:]}")
                time.sleep(0.2)
            url = f"http://127.0.0.1:{port}"
            while httpx.get(url + "/readyz").status_code != 200:
                time.sleep(0.05)
            yield StartedServer(url, process.pid, int(ready.group(1)), log_path)
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def read_metrics(url: str) -> dict[str, float]:
    """The unlabelled ``splitfuse_*`` samples of ``/metrics``: name -> value."""
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.fullmatch(r"(splitfuse_\w+) (\S+)", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


# -- the clients --------------------------------------------------------------------------


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 60)))
    return f"{_SHARED_PREFIX} {words}" if rng.random() < 0.3 else words


def _invalid_request(rng: random.Random) -> tuple[str, dict[str, Any] | bytes]:
    """A (path, body) that the server must refuse with a 4xx."""
    prompt = _prompt(rng)
    choices: list[tuple[str, dict[str, Any] | bytes]] = [
        ("/v1/completions", b'{"prompt": "unfinished'),
        ("/v1/completions", b"\xff\xfe not json"),
        ("/v1/completions", {"prompt": prompt, "max_tokens": -1}),
        ("/v1/completions", {"prompt": prompt, "temperature": "hot"}),
        ("/v1/completions", {"prompt": [[-5, 3]]}),
        ("/v1/completions", {"prompt": prompt, "model": "no-such-model"}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 10**7}),  # beyond the context
        ("/v1/completions", {"max_tokens": 4}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": prompt}]}),
        ("/v1/chat/completions", {"messages": "hello", "stream": True}),
    ]
    return rng.choice(choices)


async def _post(
    client: httpx.AsyncClient, path: str, body: dict[str, Any] | bytes, **kwargs: Any
) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return await client.post(path, content=body, headers=headers, **kwargs)
    return await client.post(path, json=body, **kwargs)


async def _read_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], max_lines: int | None
) -> tuple[int, bool]:
    """Streams ``body``; closes the connection after ``max_lines`` lines (None: reads to the
    end). Returns the status and whether the client left before the end."""
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, False
        num_lines = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return 200, False
            num_lines += 1
            if max_lines is not None and num_lines > max_lines:
                return 200, True  # leaving the block closes the connection
        return 200, False


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random) -> Outcome:
    """Sends one request of ``kind``; its outcome as the client saw it."""
    completion = {"prompt": _prompt(rng), "max_tokens": rng.randint(1, 32)}
    if rng.random() < 0.2:
        completion["n"] = 2
    chat = {
        "messages": [{"role": "user", "content": _prompt(rng)}],
        "max_tokens": rng.randint(1, 32),
    }
    if "chat" in kind:
        path, body = "/v1/chat/completions", chat
    else:
        path, body = "/v1/completions", completion
    if kind in ("complete", "chat"):
        response = await _post(client, path, body)
        return Outcome(kind, response.status_code, unexpected=response.status_code != 200)
    if kind in ("complete_stream", "chat_stream"):
        status, _ = await _read_stream(client, path, body, None)
        return Outcome(kind, status, unexpected=status != 200)
    if kind == "stream_disconnect":
        path, body = rng.choice([("/v1/completions", completion), ("/v1/chat/completions", chat)])
        body = {**body, "max_tokens": 400, "ignore_eos": True}
        status, left = await _read_stream(client, path, body, rng.randint(0, 8))
        return Outcome(kind, status, disconnected=left, unexpected=status != 200)
    if kind == "abort":
        body = {**completion, "max_tokens": 400, "ignore_eos": True}
        try:
            response = await _post(client, "/v1/completions", body, timeout=rng.uniform(0.05, 1))
        except httpx.TimeoutException:  # the connection is closed: the server aborts the request
            return Outcome(kind, None, disconnected=True)
        return Outcome(kind, response.status_code, unexpected=response.status_code != 200)
    assert kind == "invalid"
    path, invalid = _invalid_request(rng)
    response = await _post(client, path, invalid)
    return Outcome(kind, response.status_code, unexpected=not 400 <= response.status_code < 500)


async def send_requests(
    url: str,
    num_requests: int,
    concurrency: int,
    seed: int,
    request_timeout: float,
    on_progress: Any = None,
) -> list[Outcome]:
    """``num_requests`` requests of random kinds, ``concurrency`` at a time. ``on_progress(done)``
    is called after every tenth of them."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=num_requests)
    seeds = [rng.randrange(2**32) for _ in range(num_requests)]
    outcomes: list[Outcome] = []
    next_index = 0
    step = max(1, num_requests // 10)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < num_requests:
                index = next_index
                next_index += 1
                kind = kinds[index]
                try:
                    outcome = await asyncio.wait_for(
                        one_request(client, kind, random.Random(seeds[index])), request_timeout
                    )
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    outcome = Outcome(kind, None, hung=True)
                except httpx.TransportError:  # the server dropped the connection
                    outcome = Outcome(kind, None, unexpected=True)
                outcomes.append(outcome)
                if on_progress is not None and len(outcomes) % step == 0:
                    on_progress(len(outcomes))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def wait_until_idle(url: str, timeout: float) -> dict[str, float]:
    """Polls ``/metrics`` until nothing runs, waits or holds a KV block (or ``timeout``
    seconds); returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(url)
        idle = (
            metrics.get("splitfuse_num_requests_running", 0) == 0
            and metrics.get("splitfuse_num_requests_waiting", 0) == 0
            and metrics.get("splitfuse_kv_cache_usage_ratio", 0) == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def soak(
    url: str,
    pid: int | None,
    num_kv_blocks: int | None,
    num_requests: int,
    *,
    warmup: int = 200,
    concurrency: int = 16,
    seed: int = 0,
    request_timeout: float = 60.0,
    settle_timeout: float = 30.0,
    verbose: bool = False,
) -> SoakReport:
    """Warms the server up, reads its RSS, sends the requests, lets it settle, reads it again."""
    report = SoakReport()

    def sample_rss(done: int) -> None:
        if pid is not None:
            report.rss_samples_mib.append(resident_mib(pid))
        if verbose:
            print(f"  {done:,} requests ...", file=sys.stderr, flush=True)

    if warmup:
        asyncio.run(send_requests(url, warmup, concurrency, seed + 1, request_timeout))
        wait_until_idle(url, settle_timeout)
    report.rss_before_mib = resident_mib(pid) if pid is not None else None
    start = time.perf_counter()
    outcomes = asyncio.run(
        send_requests(url, num_requests, concurrency, seed, request_timeout, sample_rss)
    )
    report.duration_s = time.perf_counter() - start
    metrics = wait_until_idle(url, settle_timeout)
    report.rss_after_mib = resident_mib(pid) if pid is not None else None
    report.num_requests = len(outcomes)
    report.kinds = Counter(outcome.kind for outcome in outcomes)
    report.statuses = Counter(
        "none" if outcome.status is None else str(outcome.status) for outcome in outcomes
    )
    report.num_disconnects = sum(outcome.disconnected for outcome in outcomes)
    report.num_hung = sum(outcome.hung for outcome in outcomes)
    report.num_unexpected = sum(outcome.unexpected for outcome in outcomes)
    report.num_running = metrics.get("splitfuse_num_requests_running", 0.0)
    report.num_waiting = metrics.get("splitfuse_num_requests_waiting", 0.0)
    report.kv_cache_usage = metrics.get("splitfuse_kv_cache_usage_ratio", 0.0)
    if num_kv_blocks is not None:
        report.leaked_blocks = round(report.kv_cache_usage * num_kv_blocks)
    return report


# -- the command --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder or name to serve (default: the default)")
    parser.add_argument(
        "--tiny-model", type=Path, metavar="DIR", help="serve the tiny random model, built in DIR"
    )
    parser.add_argument("--url", help="soak a running server instead of starting one")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's pid, for RSS")
    parser.add_argument("--num-kv-blocks", type=int, help="with --url: its KV block count")
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=200, help="requests before RSS is read")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds; then hung")
    parser.add_argument("--max-rss-growth-mib", type=float, default=50.0)
    parser.add_argument(
        "--serve-args", default="", help="extra flags for splitfuse serve (e.g. '--no-compile')"
    )
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.warmup < 0:
        parser.error("--num-requests and --concurrency must be >= 1, --warmup >= 0")
    if sum(option is not None for option in (args.model, args.tiny_model, args.url)) > 1:
        parser.error("give one of --model, --tiny-model and --url")
    options = dict(
        warmup=args.warmup,
        concurrency=args.concurrency,
        seed=args.seed,
        request_timeout=args.request_timeout,
        verbose=True,
    )
    if args.url:
        report = soak(args.url, args.server_pid, args.num_kv_blocks, args.num_requests, **options)
        title = args.url
    else:
        model = args.model
        if args.tiny_model is not None:
            sys.path.insert(0, str(REPO))
            from tests.tiny_model import make_tiny_model

            args.tiny_model.mkdir(parents=True, exist_ok=True)
            if not (args.tiny_model / "config.json").exists():
                make_tiny_model(args.tiny_model, "llama")
            model = str(args.tiny_model)
        log_path = Path(tempfile.mkstemp(prefix="splitfuse-soak-", suffix=".log")[1])
        print(f"starting splitfuse serve (log: {log_path})", file=sys.stderr, flush=True)
        with serve(model, args.serve_args.split(), log_path) as server:
            report = soak(
                server.url, server.pid, server.num_kv_blocks, args.num_requests, **options
            )
        title = f"splitfuse serve {model or '(default model)'} {args.serve_args}".strip()
    print(f"soak of {title}:\n{report.format()}")
    problems = report.problems(args.max_rss_growth_mib)
    print("FAILED: " + "; ".join(problems) if problems else "passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

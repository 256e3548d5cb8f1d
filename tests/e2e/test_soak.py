"""A short soak (``benchmarks/soak.py``): 300 requests with clients that disconnect, abort and send
invalid bodies, against ``splitfuse serve`` on the tiny model in a subprocess; nothing may leak
or hang, and the server's resident memory stays flat."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import serve, soak

# Generous for 300 requests after a warm-up; leaks of per-request state show as steady growth.
MAX_RSS_GROWTH_MIB = 30


@pytest.mark.slow
def test_a_short_soak_leaks_nothing(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN keeps one kernel per row count of each matrix product, up to 1,024 in each of two
    # caches: that growth is bounded and measured by the full soak; capped here, so that a
    # short run sees the server's own growth only.
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "16")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    serve_args = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-compile"]
    with serve(str(tiny_llama_dir), serve_args, tmp_path / "server.log") as server:
        report = soak(
            server.url, server.pid, server.num_kv_blocks, 300, warmup=100, request_timeout=30
        )
    print(report.format())
    assert report.num_requests == 300
    assert report.num_disconnects > 50  # the run did exercise disconnects and aborts
    assert report.statuses["400"] > 20
    assert report.num_hung == 0 and report.num_unexpected == 0 and report.num_5xx == 0
    assert report.num_running == report.num_waiting == 0
    assert report.leaked_blocks == 0
    assert report.rss_growth_mib is not None and report.rss_growth_mib < MAX_RSS_GROWTH_MIB
    assert report.problems(MAX_RSS_GROWTH_MIB) == []

"""``splitfuse bench`` against a real server, and its offline mode."""

from __future__ import annotations

import json
from pathlib import Path

from server.cli import main
from server.runner import ServerThread


def test_bench_against_the_server_writes_json(
    tiny_server: ServerThread, tmp_path: Path, capsys
) -> None:  # noqa: ANN001
    output = tmp_path / "bench.json"
    code = main(
        ["bench", "--base-url", tiny_server.url, "--num-prompts", "6", "--input-len", "16",
         "--output-len", "5", "--concurrency", "3", "--vocab-size", "1000", "--warmup", "1",
         "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(output.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 30
    assert summary["total_prompt_tokens"] == 96
    assert summary["output_throughput"] > 0
    assert summary["ttft"]["p99_ms"] >= summary["ttft"]["p50_ms"] > 0
    assert summary["tpot"]["p50_ms"] > 0
    report = capsys.readouterr().out
    assert "output token throughput" in report and "ttft" in report


def test_bench_poisson_rate(tiny_server: ServerThread) -> None:
    code = main(
        ["bench", "--base-url", tiny_server.url, "--num-prompts", "4", "--input-len", "8",
         "--output-len", "3", "--request-rate", "20", "--vocab-size", "1000", "--warmup", "0"]
    )  # fmt: skip
    assert code == 0


def test_bench_offline(tiny_llama_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "offline.json"
    code = main(
        ["bench", "--offline", str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-memory",
         "64MiB", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
         "--concurrency", "2", "--vocab-size", "1000", "--warmup", "2", "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(output.read_text())
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 16


def test_bench_unreachable_server_fails_cleanly(capsys) -> None:  # noqa: ANN001
    code = main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert code == 1
    assert "splitfuse bench" in capsys.readouterr().err


def test_bench_offline_profile_writes_breakdown_and_trace(
    tiny_llama_dir: Path, tmp_path: Path, capsys
) -> None:  # noqa: ANN001
    output = tmp_path / "offline.json"
    trace_dir = tmp_path / "trace"
    code = main(
        ["bench", "--offline", str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-memory",
         "16MiB", "--num-prompts", "3", "--input-len", "12", "--output-len", "3",
         "--vocab-size", "1000", "--warmup", "0", "--no-compile", "--profile",
         "--profile-dir", str(trace_dir), "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    profile = json.loads(output.read_text())["profile"]
    assert profile["num_steps"] == 3  # the prompts together, then a decode step per token
    assert profile["forward_ms"] > profile["attention_ms"] > 0
    assert profile["sampling_ms"] > 0 and profile["scheduling_ms"] > 0
    trace = json.loads((trace_dir / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"splitfuse.forward", "splitfuse.sampling", "splitfuse::attend"} <= names
    report = capsys.readouterr().out
    assert "per step" in report and "attention" in report and "trace.json" in report


def test_bench_profile_needs_offline(capsys) -> None:  # noqa: ANN001
    assert main(["bench", "--profile"]) == 2
    assert "need --offline" in capsys.readouterr().err

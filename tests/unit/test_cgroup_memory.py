"""The KV cache's default budget (a fraction of free memory) respects a container's memory limit:
a pod limited to 4 GiB on a 64 GiB node must not size its cache from the node's free memory."""

from __future__ import annotations

from pathlib import Path

from engine.kv_cache_memory import cgroup_available_bytes

GIB = 2**30


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return path


def test_v2_limit_minus_the_working_set(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(
        root / "kubepods" / "pod1",
        {
            "memory.max": str(4 * GIB),
            "memory.current": str(3 * GIB),
            "memory.stat": f"anon 123\ninactive_file {GIB}\nactive_file 5\n",
        },
    )
    proc = _proc(tmp_path, "0::/kubepods/pod1\n")
    assert cgroup_available_bytes(proc, root) == 2 * GIB  # 4 - (3 - 1 reclaimable)


def test_v2_the_tightest_ancestor_wins_and_max_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root / "a", {"memory.max": str(GIB), "memory.current": "0", "memory.stat": ""})
    _write(root / "a" / "b", {"memory.max": "max", "memory.current": "0", "memory.stat": ""})
    proc = _proc(tmp_path, "0::/a/b\n")
    assert cgroup_available_bytes(proc, root) == GIB
    _write(root / "a", {"memory.max": "max"})
    assert cgroup_available_bytes(proc, root) is None


def test_v2_inside_a_cgroup_namespace(tmp_path: Path) -> None:
    """The container sees its own cgroup at the mount's root while the path names the host's."""
    root = tmp_path / "fs"
    _write(root, {"memory.max": str(2 * GIB), "memory.current": str(GIB), "memory.stat": ""})
    proc = _proc(tmp_path, "0::/kubepods/burstable/pod9/abc\n")
    assert cgroup_available_bytes(proc, root) == GIB


def test_v1_memory_controller(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(
        root / "memory" / "docker" / "c1",
        {
            "memory.limit_in_bytes": str(8 * GIB),
            "memory.usage_in_bytes": str(2 * GIB),
            "memory.stat": f"cache 9\ntotal_inactive_file {GIB}\n",
        },
    )
    _write(
        root / "memory",
        {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1"},
    )
    proc = _proc(tmp_path, "12:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    assert cgroup_available_bytes(proc, root) == 7 * GIB


def test_no_cgroup_or_unreadable_files_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_available_bytes(tmp_path / "missing", tmp_path) is None
    root = tmp_path / "fs"
    _write(root / "x", {"memory.max": "garbage", "memory.current": "1", "memory.stat": ""})
    assert cgroup_available_bytes(_proc(tmp_path, "0::/x\n"), root) is None

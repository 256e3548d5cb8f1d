"""Reading safetensors checkpoints, memory-mapped, one tensor (or one slice of it) at a time.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``, or
several ``*.safetensors`` files. Pickled checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``)
are refused, never unpickled: loading them can run arbitrary code.

Tensors are handed out as safetensors slices (``get_slice``): a tensor-parallel rank reads only its
rows or columns of each weight, and nothing is read until it is indexed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
# quantized weights kept beside the float ones (engine/gguf_quantized.py), read on their own
QUANTIZED_FILE = "quantized.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class WeightsError(ValueError):
    """The model folder's weights are missing, unsafe or do not match the model."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The folder's safetensors files, in a stable order."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise WeightsError(f"{index_path} is malformed: {error}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise WeightsError(f"{INDEX_FILE} lists missing shards: {', '.join(missing)}")
        return files
    files = sorted(path for path in model_dir.glob("*.safetensors") if path.name != QUANTIZED_FILE)
    if files:
        return files
    pickled = sorted(path.name for path in model_dir.iterdir() if path.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise WeightsError(
            f"{model_dir} holds only pickled weights ({', '.join(pickled)}); they are refused "
            "because unpickling can run arbitrary code. Convert them to safetensors first."
        )
    raise WeightsError(f"no *.safetensors weights in {model_dir}")


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """Yields ``(name, slice)`` for every tensor of every shard. A slice has ``get_shape()`` and
    ``get_dtype()``, and indexing it (``s[:]``, ``s[a:b]``, ``s[:, a:b]``) reads a torch tensor."""
    with ExitStack() as stack:
        for path in safetensors_files(model_dir):
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_slice(name)

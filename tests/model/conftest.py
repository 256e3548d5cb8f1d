"""Fixtures for the model tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Runs a module's tests on one CPU thread: tiny models gain nothing from more, and OpenMP
    threads spin-waiting on a busy machine can make each op many times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

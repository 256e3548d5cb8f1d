"""Test-wide setup. TRITON_INTERPRET must be set before any @triton.jit function is defined."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

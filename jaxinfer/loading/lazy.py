"""A checkpoint's tensors read one at a time, when asked for, and never kept.

Why: a loader that first builds a dict of every tensor (dequantized from GGUF, read from
safetensors) and then copies each into the model holds two copies of the weights at its
peak (1.4 GB for the 135M default model in float32). Read lazily, the model building loop
holds one host tensor at a time (benchmarks/RESULTS.md, "Start-up").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable

import numpy as np


class LazyTensors(Mapping):
    """name -> numpy array, produced by ``read(name)`` on every ``[name]`` (not cached: a
    second access reads again). Membership, iteration and ``len`` cost nothing."""

    def __init__(self, names: list[str], read: Callable[[str], np.ndarray]):
        self._names = dict.fromkeys(names)
        self._read = read

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

"""Backend -> attention implementation, chosen once at start-up and logged.

All implementations share one signature (see attention/xla.py): q [T, H, D], the layer's
K/V pages, kv_lens, q_lens, page_table, and the static bucket layout.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax

log = logging.getLogger("jaxinfer")

IMPLEMENTATIONS = ("auto", "xla")


def select(name: str = "auto") -> tuple[str, Callable]:
    """Returns (the implementation's name, the function)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention: unknown implementation {name!r}; choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    from jaxinfer.attention.xla import ragged_paged_attention

    backend = jax.default_backend()
    # Pallas kernels (TPU Mosaic / GPU) plug in here once they exist; until then every
    # backend runs the pure-jnp path, which is also their reference.
    chosen = "xla"
    log.info("attention: %s on backend %s", chosen, backend)
    return chosen, ragged_paged_attention

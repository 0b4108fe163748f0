"""Mixture-of-experts MLP pieces: top-k routing and a grouped matmul over experts.

Routing (``route``) is transformers': softmax of the router logits in float32, the top k,
renormalized when the config says so. The experts run as one grouped matmul
(``grouped_expert_mlp``): the step's (token, expert) pairs are sorted by expert, each
expert's rows padded to whole tiles, and one ``lax.map`` over the tiles multiplies each
tile by its expert's weights (no Python loop over experts or tokens; tiles past the used
ones are skipped at run time).

Batch invariance: a token's routing and output must not depend on the other tokens of its
step. Every dot runs through the f32 C++ kernel (invariant for any row count) or XLA's
dot padded to matmul.INVARIANT_TILE rows (one dot shape for every tile), so a row's
product never depends on which rows share its tile; the softmax and the renormalization
sum with reductions.row_sum (a fixed order whatever the row count);
each token adds its experts' outputs in increasing expert order, as transformers does.

Expert parallelism: under tensor parallelism each device holds num_experts / tp experts
(sharding.py's "expert" axis), routes every token (the router is replicated), runs the
pairs whose expert it holds and contributes zeros for the rest; one all-reduce sums them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxinfer import matmul as M
from jaxinfer.models.base import MatmulFn
from jaxinfer.reductions import row_sum


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """logits f32[T, E] -> (weights f32[T, k], experts i32[T, k]), each token's experts in
    increasing index order (the order their outputs are added in)."""
    e = jnp.exp(logits - logits.max(axis=-1, keepdims=True))           # max: exact in any order
    probs = e / row_sum(e)[:, None]
    w, idx = jax.lax.top_k(probs, top_k)
    if normalize:
        w = w / row_sum(w)[:, None]
    order = jnp.argsort(idx, axis=-1)
    return jnp.take_along_axis(w, order, -1), jnp.take_along_axis(idx, order, -1)


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile for a step of ``num_pairs`` (token, expert) pairs: about one tile per
    expert, a power of two in [2, matmul.INVARIANT_TILE] (the tiles' matmul keeps each dot
    batch-invariant at any of these sizes: jaxinfer/matmul.py)."""
    per_expert = -(-num_pairs // max(num_experts, 1))
    return max(2, min(M.INVARIANT_TILE, 1 << (per_expert - 1).bit_length()))


def grouped_expert_mlp(x: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array, act: Callable[[jax.Array], jax.Array], mm: MatmulFn,
                       first_expert: jax.Array | int = 0) -> jax.Array:
    """x [T, D], experts i32[T, k] (global ids) -> y [T, k, D]: each pair's gated-MLP output
    through its expert (w_gate / w_up [E_local, D, F], w_down [E_local, F, D], this
    device's experts ``first_expert`` ..); zeros for pairs whose expert is elsewhere."""
    T, k = experts.shape
    E = w_gate.shape[0]
    R = T * k
    tile = tile_rows(R, E)
    n_tiles = R // tile + min(E, R)                    # each used expert wastes < one tile
    local = experts.reshape(R) - first_expert                                   # [R]
    key = jnp.where((local >= 0) & (local < E), local, E)                       # E: not here
    order = jnp.argsort(key, stable=True)                                       # pairs by expert
    counts = jnp.zeros(E + 1, jnp.int32).at[key].add(1)[:E]                     # [E]
    tiles = -(-counts // tile)
    first_tile = jnp.cumsum(tiles) - tiles                                      # [E]
    first_pair = jnp.cumsum(counts) - counts
    sorted_key = key[order]
    mine = sorted_key < E
    e_of = jnp.minimum(sorted_key, E - 1)
    rank = jnp.arange(R) - first_pair[e_of]
    dest = jnp.where(mine, first_tile[e_of] * tile + rank, n_tiles * tile)      # [R] padded row
    # padded row -> the pair it holds (R: none, a zero row)
    row_pair = jnp.full(n_tiles * tile + 1, R, jnp.int32).at[dest].set(order.astype(jnp.int32))
    token = jnp.where(row_pair[:-1] < R, row_pair[:-1] // k, T)                  # T: a zero row
    x_rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])[token].reshape(n_tiles, tile, -1)
    tile_expert = jnp.minimum(jnp.searchsorted(first_tile + tiles, jnp.arange(n_tiles), side="right"), E - 1)
    used = jnp.sum(tiles)

    def one_tile(args):
        j, xt, e = args                                                         # xt [tile, D]

        def run(xt):
            h = act(mm(xt, w_gate[e])) * mm(xt, w_up[e])                        # [tile, F]
            return mm(h, w_down[e])                                             # [tile, D]

        return jax.lax.cond(j < used, run, jnp.zeros_like, xt)

    y_rows = jax.lax.map(one_tile, (jnp.arange(n_tiles), x_rows, tile_expert))  # [n_tiles, tile, D]
    y_rows = jnp.concatenate([y_rows.reshape(n_tiles * tile, -1), jnp.zeros_like(x[:1])])
    pair_row = jnp.zeros(R, jnp.int32).at[order].set(dest)                      # pair -> its row
    return y_rows[pair_row].reshape(T, k, -1)


def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
    """y [T, k, D] (experts in increasing order), weights [T, k] -> [T, D]: each output
    scaled by its weight, added one after another (0 + first: transformers' index_add_)."""
    w = weights.astype(y.dtype)
    out = y[:, 0] * w[:, :1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j] * w[:, j:j + 1]
    return out

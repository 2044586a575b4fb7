"""Random inputs already in the chunked layout ``[R, HV, NC, C, D]``."""

import jax.numpy as jnp
import numpy as np

from kdax._layouts.layout import ChunkLayout
from kdax.ref import _chunk, kda_gate

from .._util import jitted

# kdax.ref's chunked formulas, jitted (tests/_util.py: jitted)
intra_chunk, pairwise_decay, state_scan, wy_chunk, output_chunk = (
    jitted(f) for f in (_chunk.intra_chunk, _chunk.pairwise_decay, _chunk.state_scan, _chunk.wy_chunk,
                        _chunk.output_chunk))


def chunked(seed=0, R=2, HV=2, NC=3, C=16, K=8, V=4, strong=False):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s))
    g = -r.uniform(0.01, 0.4, size=(R, HV, NC, C, K))
    if strong:
        g[r.uniform(size=g.shape) < 0.05] = -1000.0
    x = dict(
        q=f(R, HV, NC, C, K), k=f(R, HV, NC, C, K) / np.sqrt(K), v=f(R, HV, NC, C, V),
        beta=jnp.asarray(r.uniform(0.05, 0.95, size=(R, HV, NC, C))),
        G=jnp.cumsum(jnp.asarray(g), axis=-2), h0=f(R, HV, K, V) * 0.3,
        first=jnp.asarray(np.where(np.arange(NC)[None] == 0, np.arange(R)[:, None], -1), jnp.int32),
        last=jnp.asarray(np.where(np.arange(NC)[None] == NC - 1, np.arange(R)[:, None], -1), jnp.int32),
        empty=jnp.zeros((R,), bool), scale=0.37,
    )
    x["layout"] = ChunkLayout(x["first"], x["last"], jnp.ones((R, NC, C), bool), x["empty"], None, NC * C, C, dense=True)
    return x


def layout_of(first, last, empty):
    """A layout with the given sequence boundaries (``first``/``last`` ``[R, NC]``)."""
    R, NC = first.shape
    return ChunkLayout(first, last, jnp.ones((R, NC, 1), bool), jnp.asarray(empty), None, NC, 1)


def rand_like(x, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=x.shape), x.dtype)


def in_kernel_decay(g, A_log, dt_bias, lower_bound=None):
    """The in-kernel gate's activated log decay of raw ``g [R, HV, NC, C, K]``, before F1's
    clamp at the floor (``kdax.ref.kda_gate`` over the head axis)."""
    return jnp.moveaxis(kda_gate(jnp.moveaxis(g, 1, -2), A_log, dt_bias, lower_bound), -2, 1)

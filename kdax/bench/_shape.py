"""The benchmark's problem: its shape, random inputs, the loss's cotangent and the FLOP model."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from .._annotations import Beta, Gate, QK, Values


@dataclasses.dataclass
class Shape:
    B: int = 1
    T: int = 4096
    H: int = 8
    HV: int = 8
    K: int = 128
    V: int = 128
    chunk_size: int = 64


def make_inputs(s: Shape, seed: int = 0, dtype=jnp.float32) -> tuple[QK, QK, Values, Gate, Beta]:
    """``(q, k, v, g, beta)`` at shape ``s``: q ``[B, T, H, K]`` normal, k normal over
    ``sqrt(K)``, v ``[B, T, HV, V]`` normal, the log-decay g ``[B, T, HV, K]`` in
    ``[-0.1, -0.005]``, beta ``[B, T, HV]`` in ``[0.1, 0.9]``."""
    r = np.random.default_rng(seed)
    x = dict(
        q=r.normal(size=(s.B, s.T, s.H, s.K)),
        k=r.normal(size=(s.B, s.T, s.H, s.K)) / math.sqrt(s.K),
        v=r.normal(size=(s.B, s.T, s.HV, s.V)),
        g=-r.uniform(0.005, 0.1, size=(s.B, s.T, s.HV, s.K)),
        beta=r.uniform(0.1, 0.9, size=(s.B, s.T, s.HV)),
    )
    return tuple(jnp.asarray(x[n], dtype) for n in ("q", "k", "v", "g", "beta"))


def cotangent(s: Shape, seed: int = 1, dtype=jnp.float32) -> Float[Array, "B T HV V"]:
    """The weights ``w`` of the benchmark loss ``sum(o * w)``, ``[B, T, HV, V]``."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=(s.B, s.T, s.HV, s.V)), dtype)


def flops_per_token_head(C: int, K: int, V: int) -> dict:
    """Multiply-add FLOPs (2 per MAC) per token and value head, per stage.

    Forward: F2 ``Aqk`` and ``L`` (2 x 2CK, counted dense), ``(I+L)^-1`` (C^2/3);
    F3 ``w`` (2CK), ``u`` (2CV); F4 ``w h`` and ``kg^T v_new`` (2 x 2KV); F5 ``qg h`` (2KV)
    and ``Aqk v_new`` (2CV). Backward: B0 = F3 + F4; B1 ``do v_new^T``, ``Aqk^T do``
    (2 x 2CV); B2 ``kg dh``, ``qg^T do``, ``w^T dv`` (3 x 2KV); B3 ``do h^T``,
    ``v_new dh^T``, ``dv h^T`` (3 x 2KV), ``dAkk`` and ``Akk^T [dw, du]`` (2 x (2CK + 2CV)),
    ``dL`` (2 x 2C^2); B4 four anchored products (4 x 2CK). Elementwise work is not counted.
    """
    f = {
        "F2_intra": 4 * C * K + C * C / 3,
        "F3_wy": 2 * C * K + 2 * C * V,
        "F4_state": 4 * K * V,
        "F5_output": 2 * K * V + 2 * C * V,
        "B0_recompute": 2 * C * K + 2 * C * V + 4 * K * V,
        "B1_dAv": 4 * C * V,
        "B2_dhu": 6 * K * V,
        "B3_wy_dqkg": 6 * K * V + 4 * C * K + 4 * C * V + 4 * C * C,
        "B4_intra": 8 * C * K,
    }
    f["forward"] = sum(v for k, v in f.items() if k.startswith("F"))
    f["backward"] = sum(v for k, v in f.items() if k.startswith("B"))
    return f



def _heads_mesh(devices: int):
    # (Auto: the split is stated by each path's shard_map; XLA keeps what feeds it)
    return jax.make_mesh((devices,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:devices])


def over_heads(xs: tuple, devices: int) -> tuple:
    """Arrays ``[B, T, heads, ...]`` with their heads split over the first ``devices``
    devices, where ``per_device`` paths read them."""
    mesh = _heads_mesh(devices)
    return tuple(jax.device_put(x, NamedSharding(mesh, P(None, None, "heads"))) for x in xs)


def per_device(fn, devices: int = 1):
    """``fn`` (``(q, k, v, g, beta) -> (o, ...)``) with each of ``devices`` host devices
    running it on its own heads (``jax.shard_map``), as a user spreads a computation that
    is independent per head over a CPU's cores: ``(o,)``. ``fn`` itself for one device."""
    if devices == 1:
        return fn
    heads = P(None, None, "heads")
    # (check_vma=False: the plain scan's zero carry is not typed as varying over the devices)
    local = jax.shard_map(lambda *x: fn(*x)[0], mesh=_heads_mesh(devices), in_specs=(heads,) * 5, out_specs=heads,
                          check_vma=False)
    return lambda *a: (local(*a),)

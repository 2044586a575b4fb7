"""Output family: F5 (o from the inter- and intra-chunk parts) and B1 (dAv)."""

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._typing import typecheck


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def causal_mask(C: int):
    return jnp.arange(C)[None, :] <= jnp.arange(C)[:, None]


class AbstractOutput(eqx.Module):
    """F5: ``o = scale qg h + Aqk v_new``."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        qg: Float[Array, "R HV NC C K"],
        h: Float[Array, "R HV NC K V"],
        Aqk: Float[Array, "R HV NC C C"],
        v_new: Float[Array, "R HV NC C V"],
    ) -> Float[Array, "R HV NC C V"]:
        raise NotImplementedError


class ReferenceOutput(AbstractOutput):
    """F5 in jnp."""

    @typecheck
    def __call__(
        self,
        scale: float,
        qg: Float[Array, "R HV NC C K"],
        h: Float[Array, "R HV NC K V"],
        Aqk: Float[Array, "R HV NC C C"],
        v_new: Float[Array, "R HV NC C V"],
    ) -> Float[Array, "R HV NC C V"]:
        return scale * qg @ h + Aqk @ v_new


class AbstractDAv(eqx.Module):
    """B1: ``dAqk = tril(do v_new^T)`` and the intra-chunk part of dv_new, ``Aqk^T do``."""

    @abc.abstractmethod
    def __call__(
        self,
        v_new: Float[Array, "R HV NC C V"],
        Aqk: Float[Array, "R HV NC C C"],
        do: Float[Array, "R HV NC C V"],
    ) -> tuple[Float[Array, "R HV NC C C"], Float[Array, "R HV NC C V"]]:
        raise NotImplementedError


class ReferenceDAv(AbstractDAv):
    """B1 in jnp."""

    @typecheck
    def __call__(
        self,
        v_new: Float[Array, "R HV NC C V"],
        Aqk: Float[Array, "R HV NC C C"],
        do: Float[Array, "R HV NC C V"],
    ) -> tuple[Float[Array, "R HV NC C C"], Float[Array, "R HV NC C V"]]:
        dAqk = jnp.where(causal_mask(Aqk.shape[-1]), do @ _t(v_new), 0.0)
        return dAqk, _t(Aqk) @ do

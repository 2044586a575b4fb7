"""Gradients of the arrays a pipeline's stages hold (``eqx.filter_grad`` of a model
holding a pipeline): by the stage's own VJP at its output's cotangent, where the
backward holds it. F1: exact, at B4's ``dq, dk, dbeta, dG`` (``dG`` also for ``G_lo``);
F5: exact, at ``do``; B0-B5: zero, exact (the forward does not depend on them); F2-F4:
``StageGradientError`` (the backward does not form their outputs' cotangents). A fixed
array is configuration: ``jax.lax.stop_gradient`` it or ``eqx.partition`` it out."""


import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import StageGradientError
from .._layouts.layout import pack_inputs
from ..stages import Activated, ChunkGrads
from .contracts import STAGES

# Forward stages whose arrays get exact gradients.
EXACT = ("gate", "output")


class BackwardParts(eqx.Module):
    """What the six-stage backward formed, chunked: ``doc`` (F5's cotangent), B0's ``qg``,
    ``h``, ``v_new`` (F5's inputs) and B4's gradients of F1's outputs (``act_grads``)."""

    doc: jax.Array
    qg: jax.Array
    h: jax.Array
    v_new: jax.Array
    act_grads: ChunkGrads


def check_perturbed(pipeline, perturbed, where: str = "chunk_kda") -> dict:
    """``{field: [path, ...]}``: the stage arrays being differentiated (``perturbed``: the
    flags); ``StageGradientError`` for one of a forward stage not in ``EXACT``."""
    got: dict = {}
    for path, flag in jax.tree_util.tree_flatten_with_path(perturbed)[0]:
        if flag is True:
            field = getattr(path[0], "name", str(path[0]))
            got.setdefault(field, []).append(f"pipeline{jax.tree_util.keystr(path)}")
    for field, paths in got.items():
        info = STAGES.get(field)
        if info is None or not info.forward or field in EXACT:
            continue
        cls = type(getattr(pipeline, field)).__qualname__
        raise StageGradientError(
            f"{paths[0]}: {where} is differentiated with respect to an array of the {info.step} stage "
            f"`{field}` ({cls}), and kdax's backward does not form the cotangent of that stage's output, so "
            f"it cannot give this gradient exactly (exact here: {', '.join(EXACT)}; the backward stages' arrays get their "
            f"exact zero). If the array is configuration, hold it under jax.lax.stop_gradient or leave it out "
            f"of what is differentiated (eqx.partition)."
        )
    return got


def _vjp_of_field(pipeline, field: str, cotangent_of, **kwargs):
    """The gradient of ``field``'s arrays through one ``run_stage`` call on ``kwargs``, at ``cotangent_of(out)``."""
    run = lambda s: eqx.tree_at(lambda p: getattr(p, field), pipeline, s).run_stage(field, **kwargs)
    out, vjp = eqx.filter_vjp(run, getattr(pipeline, field))
    (grad,) = vjp(cotangent_of(out))
    return grad


def _activated_cotangent(act: Activated, g: ChunkGrads) -> Activated:
    """F1's output cotangent: B4's gradients (``dG`` for ``G_lo`` too), zero for the l2norm statistics."""
    zero = lambda x: None if x is None else jnp.zeros_like(x)
    return Activated(
        q=g.dq.astype(act.q.dtype), k=g.dk.astype(act.k.dtype), beta=g.dbeta.astype(act.beta.dtype),
        G=g.dG.astype(act.G.dtype), q_rstd=zero(act.q_rstd), k_rstd=zero(act.k_rstd),
        G_lo=None if act.G_lo is None else g.dG.astype(act.G_lo.dtype),
    )


def as_pipeline_gradient(perturbed, fields: dict):
    """The gradients of stage ``fields`` as a pytree of ``perturbed``'s structure: the
    perturbed leaves only, None elsewhere (``eqx.filter_custom_vjp``'s contract)."""
    grads = jax.tree.map(lambda _: None, perturbed)
    for name, g in fields.items():
        grads = eqx.tree_at(lambda p: getattr(p, name), grads, g, is_leaf=lambda x: x is None)
    return jax.tree.map(lambda g, p: g if (p is True and g is not None) else None, grads, perturbed,
                        is_leaf=lambda x: x is None)


def pipeline_gradients(pipeline, perturbed, parts: BackwardParts, res, inputs):
    """The gradients of the perturbed stage arrays after a backward over ``res`` from the raw
    ``inputs``: F1's and F5's by their VJPs, zero elsewhere (F2-F4 refused on the way in)."""
    got = check_perturbed(pipeline, perturbed)
    if not got:
        return jax.tree.map(lambda _: None, perturbed)
    pipeline = pipeline.resolved(*res.in_dtypes[:6])  # as the backward resolved it
    L, fields = res.layout, {}
    if "gate" in got:
        qc, kc, _, gc, bc = pack_inputs(L, tuple(inputs[:5]), res.v.shape[1], res.h0.dtype)
        kw = dict(config=res.config, q=qc, k=kc, g=gc, beta=bc, A_log=res.A_log, dt_bias=res.dt_bias,
                  valid=L.valid, reset=L.reset)
        fields["gate"] = _vjp_of_field(pipeline, "gate", lambda a: _activated_cotangent(a, parts.act_grads), **kw)
    if "output" in got:
        kw = dict(scale=res.config.scale, qg=parts.qg, h=parts.h, Aqk=res.Aqk, v_new=parts.v_new)
        fields["output"] = _vjp_of_field(pipeline, "output", lambda o: parts.doc.astype(o.dtype), **kw)
    return as_pipeline_gradient(perturbed, fields)

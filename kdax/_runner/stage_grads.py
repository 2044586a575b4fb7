"""Gradients of the arrays a pipeline's stages hold, when ``chunk_kda`` is differentiated
with respect to them (``eqx.filter_grad`` of a model holding a pipeline, say).

The six-stage backward differentiates the inputs; a stage array is differentiated here,
by that stage's own VJP at the cotangent of its output, where the backward already
holds that cotangent. The rule per field:

| field | gradient of its arrays |
|---|---|
| ``gate`` (F1) | exact: the gate stage's VJP at B4's ``dq, dk, dbeta, dG`` (``dG`` also for ``G_lo``, as the later stages use ``G + G_lo``) |
| ``output`` (F5) | exact: the output stage's VJP at ``do`` |
| ``recompute``, ``dav``, ``dhu``, ``wy_dqkg``, ``intra_bwd``, ``gate_bwd`` (B0-B5) | zero, which is exact: the forward does not depend on them |
| ``intra``, ``wy``, ``state`` (F2-F4) | refused when the gradient is traced (``StageGradientError``, naming the field and the array): the backward does not form the cotangents of their outputs |

An array that should stay fixed is configuration: ``jax.lax.stop_gradient`` it, or keep it
out of what is differentiated (``eqx.partition``), and it is never perturbed.
"""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import StageGradientError
from .._layouts.layout import pack_inputs
from ..stages import Activated, ChunkGrads
from .contracts import STAGES

# Forward stages whose arrays get exact gradients (see the table above).
EXACT = ("gate", "output")


class BackwardParts(eqx.Module):
    """What the six-stage backward formed on its way, in the chunked layout: the packed
    ``doc`` (F5's cotangent), B0's ``qg``, ``h``, ``v_new`` (F5's inputs, with the
    forward's ``Aqk``), and ``act_grads``, B4's gradients of F1's outputs."""

    doc: jax.Array
    qg: jax.Array
    h: jax.Array
    v_new: jax.Array
    act_grads: ChunkGrads


def perturbed_arrays(pipeline, perturbed) -> dict:
    """``{field: [path, ...]}``: the stage arrays of ``pipeline`` being differentiated
    (``perturbed``: ``eqx.filter_custom_vjp``'s flags, the pipeline's structure)."""
    out: dict = {}
    for path, flag in jax.tree_util.tree_flatten_with_path(perturbed)[0]:
        if flag is True:
            field = getattr(path[0], "name", str(path[0]))
            out.setdefault(field, []).append(f"pipeline{jax.tree_util.keystr(path)}")
    return out


def check_perturbed(pipeline, perturbed, where: str = "chunk_kda", exact: tuple = EXACT) -> dict:
    """Raise ``StageGradientError`` for a differentiated array of a forward stage that has
    no exact gradient (``exact``: the fields that have one in this caller); return the
    perturbed arrays per field."""
    got = perturbed_arrays(pipeline, perturbed)
    for field, paths in got.items():
        info = STAGES.get(field)
        if info is None or not info.forward or field in exact:
            continue
        cls = type(getattr(pipeline, field)).__qualname__
        ok = ", ".join(exact) if exact else "none"
        raise StageGradientError(
            f"{paths[0]}: {where} is differentiated with respect to an array of the {info.step} stage "
            f"`{field}` ({cls}), and kdax's backward does not form the cotangent of that stage's output, so "
            f"it cannot give this gradient exactly (exact here: {ok}; the backward stages' arrays get their "
            f"exact zero). If the array is configuration, hold it under jax.lax.stop_gradient or leave it out "
            f"of what is differentiated (eqx.partition)."
        )
    return got


def _vjp_of_field(pipeline, field: str, cotangent_of, **kwargs):
    """The gradient of ``pipeline.<field>``'s arrays through one call of that stage with
    ``kwargs`` (the pipeline's stage runner: the same fallback, precision and checks as
    the forward), at ``cotangent_of(output)``."""
    stage = getattr(pipeline, field)

    def run(s):
        return eqx.tree_at(lambda p: getattr(p, field), pipeline, s).run_stage(field, **kwargs)

    out, vjp = eqx.filter_vjp(run, stage)
    (grad,) = vjp(cotangent_of(out))
    return grad


def _activated_cotangent(act: Activated, g: ChunkGrads) -> Activated:
    """F1's output cotangent: B4's gradients; zero for the l2norm statistics (read by B5
    alone); ``dG`` for ``G_lo``, as F2-B4 use ``G + G_lo``."""
    zero = lambda x: None if x is None else jnp.zeros_like(x)
    return Activated(
        q=g.dq.astype(act.q.dtype), k=g.dk.astype(act.k.dtype), beta=g.dbeta.astype(act.beta.dtype),
        G=g.dG.astype(act.G.dtype), q_rstd=zero(act.q_rstd), k_rstd=zero(act.k_rstd),
        G_lo=None if act.G_lo is None else g.dG.astype(act.G_lo.dtype),
    )


def stage_gradients(pipeline, perturbed, parts: BackwardParts, *, gate_kwargs: Optional[dict], Aqk, scale):
    """The gradient of every perturbed stage array, as a pytree of ``perturbed``'s
    structure (None elsewhere): F1 and F5 exact by their own VJPs, every other field's
    arrays zero (``check_perturbed`` refused the forward ones on the way in)."""
    got = perturbed_arrays(pipeline, perturbed)
    # The skeleton from ``perturbed``: the caller's pipeline structure (``pipeline`` may be
    # a variant of it that ran the backward: untiled, precision resolved).
    grads = jax.tree.map(lambda _: None, perturbed)
    for field in EXACT:
        if field not in got:
            continue
        if field == "output":
            kw = dict(scale=scale, qg=parts.qg, h=parts.h, Aqk=Aqk, v_new=parts.v_new)
            g = _vjp_of_field(pipeline, field, lambda o: parts.doc.astype(o.dtype), **kw)
        else:
            g = _vjp_of_field(pipeline, field, lambda a: _activated_cotangent(a, parts.act_grads), **gate_kwargs)
        grads = eqx.tree_at(lambda p: getattr(p, field), grads, g, is_leaf=lambda x: x is None)
    # Only the perturbed leaves (filter_custom_vjp's contract); None for the rest.
    return jax.tree.map(lambda g, p: g if (p is True and g is not None) else None, grads, perturbed,
                        is_leaf=lambda x: x is None)


def pipeline_gradients(pipeline, perturbed, parts: BackwardParts, res, inputs):
    """The gradients of ``pipeline``'s perturbed arrays (``perturbed``: the flags of the
    caller's pipeline) after a backward over ``res`` (``KDAResiduals``) from the raw
    ``inputs = (q, k, v, g, beta, ...)``: a pytree of ``perturbed``'s structure, None
    where there is none."""
    if not any(x is True for x in jax.tree.leaves(perturbed)):
        return jax.tree.map(lambda _: None, perturbed)
    pipeline = pipeline.resolved(res.in_dtypes[0])  # as the backward resolved it
    L, dt = res.layout, res.h0.dtype
    gate_kwargs = None
    if "gate" in perturbed_arrays(pipeline, perturbed):
        qc, kc, _, gc, bc = pack_inputs(L, tuple(inputs[:5]), res.v.shape[1], dt)
        gate_kwargs = dict(config=res.config, q=qc, k=kc, g=gc, beta=bc, A_log=res.A_log, dt_bias=res.dt_bias,
                           valid=L.valid, reset=L.reset)
    return stage_gradients(pipeline, perturbed, parts, gate_kwargs=gate_kwargs, Aqk=res.Aqk, scale=res.config.scale)

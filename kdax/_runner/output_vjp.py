"""F5 alone differs: the six-stage backward with F5's transpose derived (``jax.vjp`` of F5)
and every other backward stage hand-written (``kdax._runner.routes.backward_route``).

``do`` enters through three pieces of KDA's F5 (``o = scale qg h + Aqk v_new``); the VJP
of an F5 of other math at ``do`` gives ``d_qg, d_h, d_Aqk, d_v_new``, which take their
places: B1 is not run (``dAqk = d_Aqk``, ``dv_intra = d_v_new``); B2, linear in ``do``
through ``scale qg^T do``, takes ``d_h`` as ``dh_start`` where it declares that (one pass),
else runs with ``qg`` the rows of the identity (``ceil(K / C)`` passes, summed) and
``do = d_h / scale``; B3 runs with ``do = 0``, ``d_qg`` entering
through F3's ``qg = q e^G`` (``dq += d_qg e^G``, ``dG += qg d_qg``). B0, B4, B5 are
unchanged. No ``reset`` table: F5 is not KDA's, so sequences keep chunks of their own."""

import dataclasses

import equinox as eqx
import jax.numpy as jnp

from .._layouts.layout import pack
from .._numerics.arrays import identity_row_terms
from .._stage_protocol.capabilities import capabilities
from ..stages import ChunkGrads, DhuOut
from . import routes as _routes
from .forward import PlainHooks
from .residuals import KDAGrads
from .stage_grads import BackwardParts


def backward(pipeline, res, do, dht) -> tuple:
    """``(KDAGrads, BackwardParts)`` of the forward ``res`` at ``do`` ``[B, T, HV, V]`` and
    ``dht`` (or None), F5's transpose derived (module docstring)."""
    cfg, L, act = res.config, res.layout, res.act
    pipe = pipeline.resolved(*res.in_dtypes[:6])
    dt = res.h0.dtype
    doc = pack(L, do, dt)
    dht = PlainHooks().b2_dht(dht, res.h0)  # (the plain layout's: no reset table here)
    c = pipe.recomputed(res)  # B0

    def f5(stage, a):  # F5 through the stage runner, as the forward ran it
        qg, h, Aqk, v_new = a
        return dataclasses.replace(pipe, output=stage).run_stage("output", scale=cfg.scale, qg=qg, h=h, Aqk=Aqk,
                                                                  v_new=v_new)

    with _routes.derivable(pipeline, ("output",)):
        o, vjp = eqx.filter_vjp(f5, pipe.output, (c.qg, c.h, res.Aqk, c.v_new))
        _, (d_qg, d_h, d_Aqk, d_v) = vjp(doc.astype(o.dtype))

    # B2, d_h as the chunk-start states' cotangents: ``dh_start`` to a B2 declaring it (one pass),
    # else through `scale qg^T do`, C rows of the identity at a time (``identity_row_terms``).
    d_h = d_h.astype(dt)
    own = capabilities(type(pipe.dhu)).dh_start
    if own:
        dh = pipe.run_stage("dhu", scale=cfg.scale, qg=jnp.zeros_like(c.qg), kg=c.kg, w=c.w, G=act.G,
                            do=jnp.zeros_like(doc), dv_intra=d_v.astype(doc.dtype), dht=dht, layout=L, reset=None,
                            dh_start=d_h)
    for j, (eye, rows) in enumerate([] if own else identity_row_terms(d_h, c.qg, cfg.scale)):
        first = j == 0
        part = pipe.run_stage(
            "dhu", scale=cfg.scale, qg=eye, kg=c.kg, w=c.w, G=act.G, do=rows.astype(doc.dtype),
            dv_intra=d_v.astype(doc.dtype) if first else jnp.zeros_like(doc),
            dht=dht if first else jnp.zeros_like(dht), layout=L, reset=None,
        )
        dh = part if first else DhuOut(dh.dh + part.dh, dh.dh0 + part.dh0, dh.dv_new + part.dv_new)
    grads = pipe.run_stage(  # B3 without F5's qg piece, then that piece through F3's qg = q e^G
        "wy_dqkg", scale=cfg.scale, q=act.q, k=act.k, v=res.v, beta=act.beta, G=act.G, Akk=res.Akk, qg=c.qg,
        kg=c.kg, h=c.h, dh=dh.dh, v_new=c.v_new, do=jnp.zeros_like(doc), dv_new=dh.dv_new, G_lo=act.G_lo, reset=None,
    )
    d_qg = d_qg.astype(grads.dq.dtype)
    grads = ChunkGrads(grads.dq + d_qg * jnp.exp(act.G).astype(d_qg.dtype), grads.dk, grads.dv, grads.dbeta,
                       grads.dG + c.qg.astype(d_qg.dtype) * d_qg, grads.dL)
    grads = pipe.run_stage(  # B4
        "intra_bwd", scale=cfg.scale, q=act.q, k=act.k, beta=act.beta, G=act.G, dAqk=d_Aqk.astype(res.Aqk.dtype),
        grads=grads, G_lo=act.G_lo, reset=None,
    )
    raw = pipe.run_stage(  # B5
        "gate_bwd", config=cfg, act=act, g=res.g_raw, A_log=res.A_log, dt_bias=res.dt_bias, valid=L.valid,
        dq=grads.dq, dk=grads.dk, dbeta=grads.dbeta, dG=grads.dG, reset=None,
    )
    parts = BackwardParts(doc=doc, qg=c.qg, h=c.h, v_new=c.v_new, act_grads=grads)
    return KDAGrads.unpacked(L, raw, grads.dv, res.num_qk_heads, lambda: dh.dh0), parts

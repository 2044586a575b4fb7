"""Pallas output family: F5 (o) and B1 (dAv), one (p, chunk) block per program."""

from typing import ClassVar, Mapping, Optional, Union

import jax.numpy as jnp
from types import MappingProxyType

from .._layouts.tokens import Tokens
from .._stage_protocol.final import final
from .._annotations import ChunkV
from ..ref import compute_dtype
from ..stages import KDA, AbstractDAv, AbstractOutput
from ._common import PallasTarget, chunk_spec, flat, iota, loaded, token_operand, tuned, unflat
from ._shared_chunks import segment_operands


@final
class PallasOutput(AbstractOutput, PallasTarget):
    """F5: ``o = scale qg h + Aqk v_new``. With ``reset`` (shared chunks) the start state
    reaches the chunk's first sequence only, and a non-finite row of ``v_new`` its own
    sequence only (as ``kdax.stages.ReferenceOutput``)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe", "half_stored"})

    @tuned
    def __call__(self, scale, qg, h, Aqk, v_new, reset=None, *, precision: str = "highest"):
        R, HV, NC, C, K = qg.shape
        V = v_new.shape[-1]
        self.check_widths(K=K, V=V)
        qf = self.padded(qg)
        hf = self.padded(h, axes=(-2, -1))
        vf = self.padded(v_new)
        Kp, Vp = qf.shape[-1], vf.shape[-1]

        mm = self.products(precision)

        def kernel(q_ref, h_ref, a_ref, v_ref, *rest):
            qh = mm.dot(q_ref[...], h_ref[...])
            seg = None if reset is None else (rest[0][...], rest[1][...])
            if seg is not None:  # (a non-finite start state times later sequences' zero rows)
                qh = jnp.where(seg[0] == 0, qh, 0.0)
            rest[-1][...] = scale * qh + mm.lower_dot(a_ref[...], v_ref[...], seg)

        ins = (qf, hf, flat(Aqk), vf)
        specs = [chunk_spec((C, Kp)), chunk_spec((Kp, Vp)), chunk_spec((C, C)), chunk_spec((C, Vp))]
        if reset is not None:
            extra, extra_specs = segment_operands(reset, HV)
            ins, specs = ins + extra, specs + extra_specs
        (o,) = self.call(kernel, ins, specs, [(C, Vp)], R * HV, NC, compute_dtype(qg))  # (qg may be stored bf16)
        return unflat(o[..., :V], R, HV)


@final
class PallasDAv(AbstractDAv, PallasTarget):
    """B1: ``dAqk = tril(do v_new^T)``, ``dv_intra = Aqk^T do``. Reads ``do`` from the
    caller's layout when handed a ``Tokens`` view (``tokens``; Triton, ``reads_tokens``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"output": KDA})

    accepts: ClassVar[frozenset] = frozenset({"tokens", "half_stored"})

    @tuned
    def __call__(self, v_new, Aqk, do: Union[ChunkV, Tokens], *, precision: str = "highest"):
        R, HV, NC, C, V = v_new.shape
        self.check_widths(V=V)
        vf = self.padded(v_new)
        Vp = vf.shape[-1]
        df, do_spec, load = token_operand(self.target, self.view_or_copy(do, V), self.padded, (C, Vp))

        mm = self.products(precision)

        def kernel(v_ref, a_ref, do_ref, da_ref, dv_ref):
            d = loaded(do_ref, load)[...]
            row, col = iota((C, C), 0), iota((C, C), 1)
            da_ref[...] = jnp.where(col <= row, mm.dot(d, v_ref[...], tb=True), 0.0)
            dv_ref[...] = mm.dot(a_ref[...], d, ta=True)

        dA, dv = self.call(
            kernel, (vf, flat(Aqk), df), [chunk_spec((C, Vp)), chunk_spec((C, C)), do_spec],
            [(C, C), (C, Vp)], R * HV, NC, do.dtype)  # (gradients: do's dtype, v_new may be stored bf16)
        return unflat(dA, R, HV), unflat(dv[..., :V], R, HV)

"""Public type aliases for stage authors (jaxtyping, checked with ``typecheck``).

Dimension names: B batch, T time, H query/key heads, HV value heads, K key dim, V value
dim, N sequences (B, or ``len(cu_seqlens) - 1``). Inside the chunked pipeline, what the
stages see: R rows of the chunked layout, NC chunks per row, C chunk size.

===============  ==========================  =========================================
alias            shape                       what
===============  ==========================  =========================================
``QK``           ``[B, T, H, K]``            q, k as ``chunk_kda`` takes them
``Values``       ``[B, T, HV, V]``           v
``Gate``         ``[B, T, HV, K]``           g
``Beta``         ``[B, T, HV]``              beta
``State``        ``[N, HV, K, V]``           initial / final states
``ChunkK``       ``[R, HV, NC, C, K]``       q, k, G, w, qg, kg between stages
``ChunkV``       ``[R, HV, NC, C, V]``       v, u, v_new, do between stages
``ChunkScalar``  ``[R, HV, NC, C]``          beta between stages
``ChunkMat``     ``[R, HV, NC, C, C]``       Aqk, Akk
``ChunkState``   ``[R, HV, NC, K, V]``       h (each chunk's start state), dh
``SeqState``     ``[N, HV, K, V]``           a state per sequence, inside the pipeline
``ChunkValid``   ``[R, NC, C]`` (bool)       which chunk positions hold a token
===============  ==========================  =========================================

``Tokens`` stands for a ``ChunkK``/``ChunkV``/``ChunkScalar`` array: a view of the caller's
``[B, T, H, D]`` input that stages declaring ``"tokens"`` receive instead of the chunked
copy (docs/stages.md, "Capabilities").

``typecheck`` decorates a stage's ``__call__`` (or any function) so that shapes and
dtypes are checked when it is traced, with errors that name the argument::

    from kdax.typing import ChunkK, ChunkV, typecheck

    class MyOutput(kdax.stages.AbstractOutput):
        @typecheck
        def __call__(self, scale, qg: ChunkK, h, Aqk, v_new: ChunkV) -> ChunkV: ...
"""

from ._layouts.tokens import Tokens as Tokens
from ._annotations import ArrayIn as ArrayIn
from ._annotations import Beta as Beta
from ._annotations import ChunkK as ChunkK
from ._annotations import ChunkMat as ChunkMat
from ._annotations import ChunkScalar as ChunkScalar
from ._annotations import ChunkState as ChunkState
from ._annotations import ChunkV as ChunkV
from ._annotations import ChunkValid as ChunkValid
from ._annotations import Gate as Gate
from ._annotations import QK as QK
from ._annotations import SeqState as SeqState
from ._annotations import State as State
from ._annotations import Values as Values
from ._annotations import typecheck as typecheck

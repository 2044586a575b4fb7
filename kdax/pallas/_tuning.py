"""Named Triton tunings of the Pallas pipeline: ``KDAPipeline.pallas("triton", tuning=NAME)``.

A tuning sets the Triton fields of each Pallas stage (``PallasTarget``: ``num_warps``,
``num_stages``, ``f32_dot``; the state kernels' ``block_k`` rows and ``block_v`` value
columns; ``f32_tuning``, the fields a stage takes instead where its products take float32
operands) and, for the presets modelled with FLA's numerics, the pipeline's precision
policy. Tunings change compiled Triton kernels only: TPU kernels and interpret mode
ignore them (``PallasTarget``), so a tuning other than ``"default"`` is refused for the TPU
target.

What is measured (one H200, session 29, bf16 at B=1 T=16384 H=16 K=V=128;
benchmarks/results/gpu_h200/triton_candidates/): a training step of 20.10 ms with
``"default"`` (precision ``"auto"``), 15.06 ms with ``"candidate"``, 15.15 ms with
``"fastest-modelled"`` (the cost model's pick, not faster), against FLA's 8.13 ms.
``"default"`` compiles without spills on sm_90 for every kernel of a training step, dense
and packed sequences, at every precision (``"auto"`` with float32 and bf16 inputs, every
policy by name; see ``_DEFAULT``; tests/pallas/test_triton_tuning.py), but F2 on packed
sequences under float32 products (8 B a thread);
``"fastest-modelled"`` is the tuning ``benchmarks/gpu_cost_model.py`` predicted fastest,
under precision ``"fast"``, where it compiles without spills (dense and packed); under the
other policies some of its kernels spill.
"""

import dataclasses
from types import MappingProxyType
from typing import Mapping, Optional

STAGE_FIELDS = ("gate", "intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A named tuning: ``fields[stage]``, the Triton fields given to that Pallas stage
    (every stage of ``STAGE_FIELDS`` has an entry); ``precision``, the pipeline's precision
    policy it was chosen under (None: the pipeline's own, ``"auto"``)."""

    name: str
    doc: str
    fields: Mapping[str, Mapping[str, object]]
    precision: Optional[str] = None


def _every(**kw) -> dict:
    return {s: dict(kw) for s in STAGE_FIELDS}


def _tuning(name: str, doc: str, fields: dict, precision: Optional[str] = None) -> Tuning:
    assert set(fields) == set(STAGE_FIELDS), (name, sorted(fields))
    frozen = MappingProxyType({s: MappingProxyType(dict(f)) for s, f in fields.items()})
    return Tuning(name, doc, frozen, precision)


_CANDIDATE = _every(num_warps=8, num_stages=2, f32_dot="tf32x3")
for _s in ("state", "dhu"):
    _CANDIDATE[_s] = dict(_CANDIDATE[_s], block_k=64)
# The candidate with B4 on FLA's grid (``PallasIntraBackward.rows``): one program per 16-token
# sub-block and 32 feature columns, 4 warps (FLA's ``chunk_kda_bwd_kernel_intra`` at the
# config its cost matches): sm_90, 2 stages, "fast", 128 registers dense and packed, none
# spilled (4 CTAs an SM, against the whole-chunk kernel's one of 178 registers);
# benchmarks/results/b4_rows16_resources.txt. On an H200 at (1, 16384, 16) (session 67,
# benchmarks/results/gpu_h200/session67/): B4 5.13 -> 3.79 ms, the training step 15.28 -> 13.92.
_CANDIDATE_ROWS16 = {s: dict(f) for s, f in _CANDIDATE.items()}
_CANDIDATE_ROWS16["intra_bwd"] = dict(_CANDIDATE_ROWS16["intra_bwd"], num_warps=4, rows=16)
# And F2 there too (``PallasIntra.rows``): the scores one program per 16-token sub-block
# (16 feature columns a step), ``(I + L)^-1`` a second kernel per chunk, 4 warps, 1 stage:
# sm_90, no spills, the scores 96 registers under "fast" (5 CTAs an SM; 32 columns 134,
# 2 stages more), the inverse 165 (3 CTAs; the whole-chunk kernel: one of 207 at 8 warps);
# benchmarks/results/f2_rows16_resources.txt. On the H200 (session 67): F2 1.53 -> 0.85 + 0.17 ms,
# the forward 3.75 -> 3.33, the training step 13.30 (FLA's 8.14), the fastest measured.
_CANDIDATE_ROWS16_F2 = {s: dict(f) for s, f in _CANDIDATE_ROWS16.items()}
_CANDIDATE_ROWS16_F2["intra"] = dict(_CANDIDATE_ROWS16_F2["intra"], num_warps=4, num_stages=1, block_k=16, rows=16)
_FASTEST = {s: dict(f) for s, f in _CANDIDATE.items()}
_FASTEST["intra"] = dict(_FASTEST["intra"], num_warps=16)
_FASTEST["intra_bwd"] = dict(_FASTEST["intra_bwd"], num_warps=16)
for _s in ("state", "dhu"):
    _FASTEST[_s] = dict(_FASTEST[_s], block_v=32)

# The default: spill-free on sm_90 for every kernel of a training step, dense and packed,
# at every precision, but F2 packed under float32 products, 8 B a thread (16 feature
# columns: none, at +25% instructions; tests/pallas/test_triton_tuning.py; benchmarks/results/
# gpu_cost_model.txt's last line). 8 warps, 2 stages, TF32x3 float32 products; where a
# stage's products take float32 operands ("highest", and the recurrences under "bfloat16"
# / "float16", what "auto" gives float32 / bf16 inputs), its f32_tuning: F4 and B2 at 4
# warps (one warpgroup: at 8, a chained TF32x3 product of 64 rows lays its operands twice)
# and 16 value columns a program (at 8 warps and 16 or 32 columns 224 B-1.3 KiB of spills
# with their tiles loaded lazily, 13.6-14.4 KiB at the minimal tuning); F2 at 32 feature
# columns (64: 240 B); B3 at 16 x 16 columns, 1 stage, unchained TF32x3 ("tf32x3_split":
# 32 x 32 at 2 stages 608 B; 16 x 16 chained 40-104 B). B3 takes 16 feature columns at
# every precision (32: 8-16 B under "bfloat16" on packed sequences, registers at 255); B5
# at 1 stage. Registers at the edge (253-255 a thread: F2, B3 and B5 under some policies)
# leave no room: a change to those kernels must recompile them (the slow test).
_DEFAULT = _every(num_warps=8, num_stages=2, f32_dot="tf32x3")
for _s in ("state", "dhu"):
    _DEFAULT[_s] = dict(_DEFAULT[_s], block_k=64, block_v=32, f32_tuning=(("num_warps", 4), ("block_v", 16)))
_DEFAULT["intra"] = dict(_DEFAULT["intra"], f32_tuning=(("block_k", 32),))
_DEFAULT["wy_dqkg"] = dict(_DEFAULT["wy_dqkg"], block_k=16, f32_tuning=(
    ("num_stages", 1), ("block_k", 16), ("block_v", 16), ("f32_dot", "tf32x3_split")))
_DEFAULT["gate_bwd"] = dict(num_warps=8, num_stages=1, f32_dot="tf32x3")
# The default with B4 on FLA's grid as 'candidate-rows16' has it (4 warps, rows 16), at the
# pipeline's own precision: sm_90, every policy, dense and packed, 128-138 registers and no
# spills (the default's B4: one 8-warp CTA an SM). F2 stays whole-chunk: on 16-row programs
# its scores spill 24 B under float32 products and its inverse 88 B on packed input under
# every policy but "fast" (session 67). Not yet timed on a GPU: the candidate's B4 went
# 5.13 -> 3.79 ms so on an H200.
_DEFAULT_ROWS16 = {s: dict(f) for s, f in _DEFAULT.items()}
_DEFAULT_ROWS16["intra_bwd"] = dict(_DEFAULT_ROWS16["intra_bwd"], num_warps=4, rows=16)

TUNINGS: Mapping[str, Tuning] = MappingProxyType({t.name: t for t in (
    _tuning("default", "what KDAPipeline.pallas('triton') gives: no spills on sm_90 at any precision, dense and "
                       "packed (but F2's 8 B, packed under float32 products) (8 warps, 2 stages, TF32x3 float32 products, the state kernels as 64-row tiles of 32 "
                       "value columns, B3 at 16 feature columns, B5 at 1 stage; where a stage's products take "
                       "float32 operands, F4/B2 at 4 warps and 16 columns, F2 at 32 feature columns, B3 at 16 x 16 "
                       "columns, 1 stage, unchained TF32x3)", _DEFAULT),
    _tuning("default-rows16", "the default with B4 on FLA's grid: one program per 16-token sub-block "
                              "(PallasIntraBackward.rows=16) at 4 warps, no spills on sm_90 at any precision; the "
                              "pipeline's own precision; not yet timed on a GPU", _DEFAULT_ROWS16),
    _tuning("fastest-modelled", "the cost model's fastest (benchmarks/gpu_cost_model.py's BEST, "
                                "gpu_candidate_run.py's CANDIDATE_BEST): 8 warps, 2 stages, TF32x3 float32 products, "
                                "F2 and B4 at 16 warps, the state kernels as 64-row tiles of 32 value columns; "
                                "precision 'fast' (FLA's bf16 operands and storage)", _FASTEST, "fast"),
    _tuning("candidate", "the all-Triton candidate (gpu_candidate_run.py's CANDIDATE): "
                         "8 warps, 2 stages, TF32x3 float32 products, the state kernels as 64-row tiles; precision "
                         "'fast'",
            _CANDIDATE, "fast"),
    _tuning("candidate-rows16", "the candidate with B4 on FLA's grid: one program per 16-token sub-block and 32 "
                                "feature columns (PallasIntraBackward.rows=16) at 4 warps; the rest as 'candidate' "
                                "(precision 'fast'); a training step 9-13% faster than 'candidate' on an H200, at "
                                "three shapes",
            _CANDIDATE_ROWS16, "fast"),
    _tuning("candidate-rows16-f2", "'candidate-rows16' with F2 on smaller programs as well: the scores one program per "
                                   "16-token sub-block (PallasIntra.rows=16, 16 feature columns a step), (I + L)^-1 a "
                                   "second kernel per chunk, 4 warps, 1 stage; precision 'fast'; the fastest measured "
                                   "on an H200 (a training step 13-22% faster than 'candidate', the forward 11-40%, at "
                                   "three shapes)",
            _CANDIDATE_ROWS16_F2, "fast"),
    _tuning("minimal", "every field at its PallasTarget default (4 warps, 1 stage, IEEE float32 products): the "
                       "Triton pipeline's tuning before the default above; spills on sm_90", _every()),
)})


def get_tuning(name) -> Tuning:
    """The tuning named ``name`` (a key of ``TUNINGS``), or a ``ValueError`` naming the
    argument and every valid name."""
    if not isinstance(name, str) or name not in TUNINGS:
        raise ValueError(f"tuning: expected one of {tuple(TUNINGS)}, got {name!r}.")
    return TUNINGS[name]


def stage_tuning(target: str, tuning: Optional[str]) -> Tuning:
    """The tuning ``KDAPipeline.pallas`` builds its stages with for ``target``: the named
    one (None: ``"default"``) for ``"triton"``; for ``"tpu"``, whose kernels have no such
    fields, ``"minimal"`` (the fields' defaults), and a ``ValueError`` for a tuning other
    than ``"default"`` or ``"minimal"``."""
    name = "default" if tuning is None else tuning
    t = get_tuning(name)
    if target == "triton":
        return t
    if name not in ("default", "minimal"):
        raise ValueError(f"tuning: {name!r} tunes Triton kernels; target is {target!r} (pass target='triton', "
                         f"or leave tuning out).")
    return TUNINGS["minimal"]

"""Per-call static configuration passed to every stage."""

from typing import Optional

import equinox as eqx


class KDAConfig(eqx.Module):
    """The options of one ``chunk_kda`` call that change what is traced (all static)."""

    scale: float = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True, default=64)
    use_qk_l2norm_in_kernel: bool = eqx.field(static=True, default=False)
    use_gate_in_kernel: bool = eqx.field(static=True, default=False)
    lower_bound: Optional[float] = eqx.field(static=True, default=None)
    use_beta_sigmoid_in_kernel: bool = eqx.field(static=True, default=False)
    allow_neg_eigval: bool = eqx.field(static=True, default=False)
    safe_gate: bool = eqx.field(static=True, default=False)
    output_final_state: bool = eqx.field(static=True, default=False)
    disable_recompute: bool = eqx.field(static=True, default=False)

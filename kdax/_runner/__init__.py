"""How a pipeline calls and differentiates its stages: the stage runner (``runner``), the
stage table (``contracts``), routes (``routes``), the forward's route (``forward``),
residuals, the stage arrays' gradients and ``chunk_kda``'s custom VJP (docs/DESIGN.md §3)."""

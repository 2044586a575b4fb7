"""How a pipeline calls its stages and differentiates them: the stage runner and the
contract checked at each stage boundary (``runner``), the stage table (``contracts``),
which math a stage computes or transposes and the routes that follow (``routes``), the
forward's layout, casts, hooks and tiles decided before F1 (``forward``), what the
forward keeps for the backward (``residuals``), the gradients of the stages' own arrays
(``stage_grads``) and ``chunk_kda``'s custom VJP (``vjp``). Imports ``kdax._numerics``,
``kdax._layouts``, ``kdax._stage_protocol`` and the stage families; the pipeline
(``kdax.pipeline``) sits on top."""

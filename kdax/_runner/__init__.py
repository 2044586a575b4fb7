"""How a pipeline calls its stages and differentiates them: the stage runner (``runner``),
the contracts checked at each stage boundary (``contracts``), what a stage declares it
accepts (``capabilities``) and which math it computes or transposes (``derived``), final
concrete stages (``final``), the forward's layout, casts, hooks and tiles decided before F1
(``forward``), what the forward keeps for the backward (``residuals``), the
gradients of the stages' own arrays (``stage_grads``) and ``chunk_kda``'s custom VJP
(``vjp``). Imports ``kdax._numerics``, ``kdax._layouts`` and the stage families; the
pipeline (``kdax.pipeline``) sits on top."""

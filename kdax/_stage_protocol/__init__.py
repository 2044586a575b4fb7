"""What a stage class declares about itself, read by the stage runner, the plan, the
tiles and ``kdax.testing``: that kdax's concrete stages are final and trace their own
products under the precision policy (``final``), and what a stage accepts beyond its
family's required arguments (``capabilities``). Below the stage families, which import
it; imports only ``kdax._layouts`` (token views) and ``kdax._numerics`` (precision)."""

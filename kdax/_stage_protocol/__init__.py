"""What a stage class declares about itself: that kdax's concrete stages are final and take
the precision policy (``final``), what a stage accepts (``capabilities``), the output
specs' helpers (``output_specs``)."""

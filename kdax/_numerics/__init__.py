"""Numerics kdax's stages share: the precision policy of the products (``precision``), the
gate cumsum as an exact hi/lo sum (``hilo``), non-finite inputs kept inside their own
sequence (``isolation``), the affine maps of a state and their prefix scan (``affine``)
and the small array helpers of the reference stages (``ops``). Nothing here knows about
layouts or stages; everything in kdax may import it."""

import jax

# float64 oracles everywhere; float32 tests build float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)

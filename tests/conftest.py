import os

# 8 simulated CPU devices for the sharding and sequence-parallel tests (tests/parallel);
# set before jax is imported, harmless to single-device tests (they use device 0).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

# float64 oracles everywhere; float32 tests build float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)

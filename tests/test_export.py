"""``jax.export`` of kdax's calls (README, "Exporting"): kdax's checks inside a compiled
program are ``eqx.error_if`` host callbacks, which ``jax.export`` refuses; with Equinox's
``EQX_ON_ERROR=nan`` (set before import: a fresh process) every call exports, and with
``check_inputs=False`` and concrete ``cu_seqlens`` chunk_kda exports under the defaults.
The exported programs give the jitted calls' numbers; a decode step with its ``KDACache``
serializes and loads back; symbolic sizes export through the recurrent path."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import kdax

from ._util import one_device_env

_NAN_CHECKS = """
import jax, jax.numpy as jnp, numpy as np, kdax
from jax import export
r = jax.random.split(jax.random.key(0), 6)
B, T, H, K = 1, 48, 2, 8
q, k, v = (jax.random.normal(x, (B, T, H, K)) for x in r[:3])
g, beta = jax.nn.log_sigmoid(jax.random.normal(r[3], (B, T, H, K))), jax.nn.sigmoid(jax.random.normal(r[4], (B, T, H)))
cu = jnp.array([0, 20, 48], jnp.int32)
kw = dict(use_qk_l2norm_in_kernel=True)
layer = kdax.nn.KimiDeltaAttention(32, 2, 16, key=jax.random.key(0))
x = jax.random.normal(r[5], (2, 20, 32))
mask = jnp.ones((2, 20), jnp.int32).at[1, :5].set(0)
cases = {
    "chunk_kda": (lambda q, g, b, cu: kdax.chunk_kda(q, k, v, g, b, cu_seqlens=cu, **kw)[0], (q, g, beta, cu)),
    "fused_recurrent_kda": (lambda q, g, b: kdax.fused_recurrent_kda(q, k, v, g, b, **kw)[0], (q, g, beta)),
    "layer with a mask": (lambda x, m: layer(x, attention_mask=m)[0], (x, mask)),
}
for name, (f, args) in cases.items():
    exp = export.export(jax.jit(f))(*args)
    d = float(jnp.max(jnp.abs(exp.call(*args) - jax.jit(f)(*args))))
    print(f"{name}: {d:.1e}")
    assert d <= 1e-6, (name, d)
bad = jax.jit(lambda q, g, b, cu: kdax.chunk_kda(q, k, v, g, b, cu_seqlens=cu, **kw)[0])
o = export.export(bad)(q, g, beta, cu).call(q, g.at[0, 3].set(1.0), beta, cu)  # g > 0: a failed check
print("failed check gives NaN:", bool(jnp.isnan(o).any()))
# Symbolic batch and tokens: the recurrent path exports once for every shape; chunk_kda refuses.
b, t = export.symbolic_shape("b, t")
sym = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
rec = jax.jit(lambda q, k, v, g, b: kdax.fused_recurrent_kda(q, k, v, g, b, **kw)[0])
exp = export.export(rec)(sym(b, t, H, K), sym(b, t, H, K), sym(b, t, H, K), sym(b, t, H, K), sym(b, t, H))
for n in (5, 48):
    a = (q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n])
    a = tuple(jnp.concatenate([x] * 3) for x in a)
    d = float(jnp.max(jnp.abs(exp.call(*a) - rec(*a))))
    print(f"recurrent at T={n}, B=3: {d:.1e}")
    assert d <= 1e-6, d
try:
    export.export(jax.jit(lambda q, g, b: kdax.chunk_kda(q, q, q, g, b)[0]))(sym(1, t, H, K), sym(1, t, H, K),
                                                                            sym(1, t, H))
except ValueError as e:
    assert "q: shape (1, t, 2, 8) has symbolic dimensions (jax.export)" in str(e), e
    print("chunk_kda refuses symbolic shapes")
# A decode step exported, serialized and loaded back: the cache in and out (a registered node).
step = jax.jit(lambda x, c: layer(x, cache=c)[:2])
cache = layer(x, cache=layer.init_cache(2))[1]
loaded = export.deserialize(export.export(step)(x[:, :1], cache).serialize())
(y, c), (y0, c0) = loaded.call(x[:, :1], cache), step(x[:, :1], cache)
assert type(c) is type(cache), type(c)
d = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves((y, c)), jax.tree.leaves((y0, c0))))
print(f"decode step loaded back: {d:.1e}")
assert d <= 1e-6, d
"""


def test_every_call_exports_with_equinox_nan_errors():
    env = one_device_env(EQX_ON_ERROR="nan")
    out = subprocess.run([sys.executable, "-c", _NAN_CHECKS], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count(": ") >= 3 and "failed check gives NaN: True" in out.stdout, out.stdout
    assert out.stdout.count("recurrent at T=") == 2 and "chunk_kda refuses symbolic shapes" in out.stdout, out.stdout
    assert "decode step loaded back" in out.stdout, out.stdout


def test_chunk_kda_exports_without_in_program_checks():
    r = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(r.normal(size=(1, 40, 2, 8)), jnp.float32) for _ in range(4))
    g, beta = jax.nn.log_sigmoid(g), jax.nn.sigmoid(jnp.asarray(r.normal(size=(1, 40, 2)), jnp.float32))
    f = jax.jit(lambda q, g, b: kdax.chunk_kda(q, k, v, g, b, cu_seqlens=[0, 15, 40], check_inputs=False,
                                               use_qk_l2norm_in_kernel=True)[0])
    exp = export.export(f)(q, g, beta)
    assert np.array_equal(np.asarray(exp.call(q, g, beta)), np.asarray(f(q, g, beta)))

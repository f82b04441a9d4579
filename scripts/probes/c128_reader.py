"""Chip probe: reading a complex128 view back from a TPU (the device's storage reader) and ways around
XLA:TPU's RET_CHECK on it (xprecision_emitters.cc: "f64[33,9]{1,0} vs c128[33,9]{0,1}", seen when
tests/device/test_device_float64.py read a complex128 mm result).

    python3 scripts/probes/c128_reader.py        # pure JAX, no torch

Each formulation of "the 33x9 view at a traced offset of a flat c128 storage" is compiled and run on
a matmul's flat result; it prints ok/FAILED with the first line of the error.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)
a = rng.standard_normal((33, 17)) + 1j * rng.standard_normal((33, 17))
b = rng.standard_normal((17, 9)) + 1j * rng.standard_normal((17, 9))
flat = jax.jit(lambda a, b: (a @ b).reshape(-1))(a, b)
want = (a @ b)


def plain(f, start):
    return lax.dynamic_slice(f, (start,), (297,)).reshape(33, 9)


def split(f, start):
    re = lax.dynamic_slice(jnp.real(f), (start,), (297,)).reshape(33, 9)
    im = lax.dynamic_slice(jnp.imag(f), (start,), (297,)).reshape(33, 9)
    return lax.complex(re, im)


def split_out(f, start):
    re = lax.dynamic_slice(jnp.real(f), (start,), (297,)).reshape(33, 9)
    im = lax.dynamic_slice(jnp.imag(f), (start,), (297,)).reshape(33, 9)
    return re, im


def flat_out(f, start):
    return lax.dynamic_slice(f, (start,), (297,))


def static(f, start):
    return f[:297].reshape(33, 9)


def pair_of_f64_static(f, start):
    return jnp.real(f)[:297].reshape(33, 9), jnp.imag(f)[:297].reshape(33, 9)


for name, fn in [("plain", plain), ("split", split), ("split_out", split_out), ("flat_out", flat_out),
                 ("static", static), ("pair_of_f64_static", pair_of_f64_static)]:
    try:
        out = jax.jit(fn)(flat, np.int64(0))
        out = np.asarray(out[0]) + 1j * np.asarray(out[1]) if isinstance(out, tuple) else np.asarray(out)
        err = np.abs(out.reshape(33, 9) - want).max() / np.abs(want).max()
        print(f"{name}: ok, max rel error {err:.2e}")
    except Exception as e:  # noqa: BLE001  (a probe reports every failure)
        print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
print("device:", jax.devices()[0].device_kind)

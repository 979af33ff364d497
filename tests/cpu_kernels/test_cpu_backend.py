"""The ``cpu`` dW backend: quantized and every-block-kept residuals go to the kernel as stored, on
each instruction-set path; where the xla path is faster it runs instead; bsr_linear end to end."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from block_cases import dense_operand
from numerics import assert_close_scaled

import cpu_kernels
from bsr_jax import bsr_linear, from_dense
from bsr_jax.backends import dispatch as backends

ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in cpu_kernels.supported_isas(), reason=f"this CPU lacks {isa}"))
    for isa in cpu_kernels.ISAS
]
STORAGE = [None, "bfloat16", "int8", "int4"]


def uses_kernel(fn, *args) -> bool:
    # A fresh function each time: make_jaxpr reuses the trace of one it has seen, from before a
    # monkeypatch.
    return cpu_kernels.TARGET in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sparsity", [0.5, 0.0])
@pytest.mark.parametrize("storage_dtype", STORAGE)
def test_cpu_backend_matches_reference_backend(storage_dtype, sparsity, isa, monkeypatch):
    """Odd M and K (padding), every stored type, sparsity 0 (every block kept, no indices stored)."""
    if sparsity == 0.0 and storage_dtype is None:
        pytest.skip("sparsity 0 without a storage dtype keeps x itself, not blocks")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, isa)  # cpu_dw runs eagerly: the variable is read per call
    x = jax.random.normal(jax.random.key(0), (90, 70))
    bsr = from_dense(x, sparsity, 16, storage_dtype=storage_dtype)
    dy = dense_operand(bsr.padded_shape[0], 72, jnp.float32, seed=2)
    assert uses_kernel(backends.cpu_dw, bsr, dy)
    chex.assert_trees_all_close(backends.cpu_dw(bsr, dy), backends.reference_dw(bsr, dy), atol=1e-4, rtol=1e-5)


def test_every_block_kept_makes_no_dense_copy():
    """Sparsity 0 with int4 storage: the kernel reads the packed blocks; no (M, K) array and no matmul."""
    bsr = from_dense(jax.random.normal(jax.random.key(0), (256, 64)), 0.0, 16, storage_dtype="int4")
    dy = dense_operand(256, 32, jnp.float32)
    jaxpr = jax.make_jaxpr(backends.cpu_dw)(bsr, dy).jaxpr
    shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars}
    assert cpu_kernels.TARGET in str(jaxpr) and "dot_general" not in str(jaxpr)
    assert (256, 64) not in shapes and (64, 256) not in shapes


@pytest.mark.parametrize("storage_dtype", [None, "int8"])
@pytest.mark.parametrize("block", [16, (4, 16)])
def test_cpu_backend_matches_float64_reference(block, storage_dtype):
    """Blocks of under CPU_KERNEL_MIN_ROWS rows take the xla path. x has full float32 mantissas, so
    no value lies half-way between two int8 steps."""
    x = jax.random.normal(jax.random.key(0), (96, 80))
    bsr = from_dense(x, 0.5, block, storage_dtype=storage_dtype)
    dy = dense_operand(96, 72, jnp.float32, seed=2)
    assert uses_kernel(backends.cpu_dw, bsr, dy) == (bsr.block[0] >= backends.CPU_KERNEL_MIN_ROWS)
    kept = reference.kept_input(np.asarray(x), 0.5, block, storage_dtype=storage_dtype)
    expected = jnp.asarray(kept.T @ np.asarray(dy, np.float64), jnp.float32)
    assert_close_scaled(jax.jit(backends.cpu_dw)(bsr, dy), expected, jnp.float32)


def test_portable_only_cpu_takes_the_xla_path_unless_forced(monkeypatch):
    bsr = from_dense(jax.random.normal(jax.random.key(0), (64, 48)), 0.0, 16, storage_dtype="int8")
    dy = dense_operand(64, 40, jnp.float32)
    monkeypatch.setattr(cpu_kernels, "supported_isas", lambda: ("portable",))
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert not cpu_kernels.kernel_by_default() and not uses_kernel(backends.cpu_dw, bsr, dy)
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "portable")
    assert cpu_kernels.kernel_by_default() and uses_kernel(backends.cpu_dw, bsr, dy)


@pytest.mark.parametrize("sparsity", [0.7, 0.0])
@pytest.mark.parametrize("storage_dtype", ["int8", "int4"])
def test_bsr_linear_grads_equal_reference_backend(storage_dtype, sparsity):
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (4, 30, 48))
    w = jax.random.normal(kw, (48, 40)) / 7

    def grads(backend):
        loss = lambda x, w: jnp.sum(jnp.sin(bsr_linear(x, w, sparsity=sparsity, block=16, storage_dtype=storage_dtype, backend=backend)))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    chex.assert_trees_all_close(grads("cpu"), grads("reference"), atol=1e-4, rtol=1e-5)

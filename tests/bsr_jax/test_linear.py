"""bsr_linear gradients against dense jax.grad: exact dx/db, masked-dense dW, on every backend."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax import backends, bsr_linear, from_dense, residual_bytes, xla_backend


@pytest.fixture(params=["reference", "xla", "xla-batched", "cpu"])
def backend(request, monkeypatch):
    """Every dW path: "xla-batched" forces the xla backend's batched column path, which it otherwise
    takes only at kept fractions these small test shapes do not reach."""
    if request.param == "xla-batched":
        monkeypatch.setattr(xla_backend, "BATCHED_MAX_KEPT", 1.0)
        monkeypatch.setattr(xla_backend, "BATCHED_MIN_BLOCK", 1)
        return "xla"
    return request.param


def _loss_of_y(y):
    # Non-uniform dy so that a wrong dW pairing of rows and columns cannot pass.
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.linspace(-1.0, 1.0, y.shape[-1]))


def _dense_grads(x, w, b):
    return jax.grad(lambda x, w, b: _loss_of_y(x @ w + b), argnums=(0, 1, 2))(x, w, b)


def _masked_reference_dw(x, w, b, **prune):
    """dW = mask(x).T @ dy, with dy taken at the dense output, in f32 at highest precision."""
    dy = jax.grad(_loss_of_y)(x @ w + b).reshape(-1, w.shape[1]).astype(jnp.float32)
    x_kept = from_dense(x.reshape(-1, x.shape[-1]), **prune).to_dense().astype(jnp.float32)
    return jnp.matmul(x_kept.T, dy, precision="highest")


def _inputs(shape, n, dtype):
    kx, kw, kb = jax.random.split(jax.random.key(sum(shape) + n), 3)
    return (
        bf16_exact_normal(kx, shape, dtype),
        bf16_exact_normal(kw, (shape[-1], n), dtype) * 0.3,
        bf16_exact_normal(kb, (n,), dtype),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("criterion", ["l2", "l1"])
@pytest.mark.parametrize("selection", ["global", "column"])
@pytest.mark.parametrize("shape,n,block", [((4, 16, 48), 40, 16), ((3, 13, 37), 19, (8, 4))])
def test_grads_match_dense_dx_db_and_masked_dw(backend, dtype, criterion, selection, shape, n, block):
    x, w, b = _inputs(shape, n, dtype)
    prune = dict(sparsity=0.6, block=block, criterion=criterion, selection=selection)
    f = lambda x, w, b: _loss_of_y(bsr_linear(x, w, b, backend=backend, **prune))
    dx, dw, db = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, b)
    f32 = [a.astype(jnp.float32) for a in (x, w, b)]
    dx_ref, _, db_ref = _dense_grads(*f32)
    assert dx.dtype == dw.dtype == db.dtype == dtype
    assert_close_scaled((dx, db, dw), (dx_ref, db_ref, _masked_reference_dw(*f32, **prune)), dtype)


def test_sparsity_zero_is_dense(backend):
    x, w, b = _inputs((2, 24, 40), 24, jnp.float32)
    grads = jax.grad(lambda *a: _loss_of_y(bsr_linear(*a, sparsity=0.0, backend=backend)), argnums=(0, 1, 2))
    chex.assert_trees_all_close(grads(x, w, b), _dense_grads(x, w, b), atol=1e-6, rtol=1e-6)


def test_every_block_kept_gives_dense_dw(backend):
    """The block-sparse path itself (not the sparsity-0 shortcut) with all blocks kept."""
    x, w, _ = _inputs((40, 48), 24, jnp.float32)
    dy = bf16_exact_normal(jax.random.key(9), (40, 24))
    bsr = from_dense(x, 0.0, (8, 16))
    dy_padded = jnp.pad(dy, ((0, bsr.padded_shape[0] - 40), (0, 0)))
    dw = backends.BACKENDS[backend](bsr, dy_padded)[:48]
    chex.assert_trees_all_close(dw, jnp.matmul(x.T, dy, precision="highest"), atol=1e-5, rtol=1e-5)


def test_forward_is_bitwise_dense():
    x, w, b = _inputs((4, 16, 48), 40, jnp.float32)
    chex.assert_trees_all_equal(bsr_linear(x, w, b, sparsity=0.9), x @ w + b)


def test_residuals_hold_no_dense_copy_of_x():
    x, w, b = _inputs((8, 64, 96), 128, jnp.float32)
    f = jax.jit(lambda w, x: jnp.sum(jnp.sin(bsr_linear(x, w, b, sparsity=0.75, block=16))))
    res = residual_bytes(f, w, x)
    assert all(r.shape != x.shape and r.shape != (512, 96) for r in res.residuals)
    kept_values = int(0.25 * (512 // 16) * (96 // 16)) * 16 * 16 * 4
    indices = 48 * 2 + 7 * 4  # int16 block rows, int32 column pointer
    # Activations: kept blocks + indices + sin's saved cosine of the (8, 64, 128) output.
    assert res.activations == kept_values + indices + 8 * 64 * 128 * 4
    assert res.inputs == 0 and res.params == w.nbytes


def test_transformations_jit_vmap_scan_checkpoint_value_and_grad():
    x, w, b = _inputs((6, 16, 32), 16, jnp.float32)
    layer = functools.partial(bsr_linear, sparsity=0.5, block=8, backend="xla")
    loss = lambda w, x: _loss_of_y(layer(x, w, b))
    per_example = jnp.stack([jax.grad(loss)(w, xi) for xi in x])
    chex.assert_trees_all_close(jax.vmap(jax.grad(loss), (None, 0))(w, x), per_example, atol=1e-5, rtol=1e-5)

    def scanned(w, xs):
        return jax.lax.scan(lambda c, xi: (c + loss(w, xi), None), 0.0, xs)[0]

    chex.assert_trees_all_close(jax.jit(jax.grad(scanned))(w, x), per_example.sum(0), atol=1e-4, rtol=1e-5)
    value, grad = jax.jit(jax.value_and_grad(jax.checkpoint(loss)))(w, x)
    chex.assert_trees_all_close((value, grad), (loss(w, x), jax.grad(loss)(w, x)), atol=1e-4, rtol=1e-5)


def test_nan_in_activations_reaches_dw_not_crash():
    x, w, b = _inputs((32, 32), 8, jnp.float32)
    x = x.at[3, 3].set(jnp.nan)
    # A linear loss keeps dy finite, so only the NaN input element can reach dW: it ranks first, its
    # block is the one kept, and it poisons exactly the dW row of its input column.
    loss = lambda w: jnp.sum(bsr_linear(x, w, b, sparsity=0.9, block=16) * jnp.linspace(-1.0, 1.0, 8))
    dw = jax.jit(jax.grad(loss))(w)
    assert jnp.all(jnp.isnan(dw[3])) and not jnp.any(jnp.isnan(jnp.delete(dw, 3, axis=0)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sparsity=1.0), "sparsity"),
        (dict(sparsity=-0.5), "sparsity"),
        (dict(sparsity=0.5, block=0), "block"),
        (dict(sparsity=0.5, block=(16, -1)), "block"),
        (dict(sparsity=0.5, criterion="max"), "criterion"),
        (dict(sparsity=0.5, selection="rows"), "selection"),
        (dict(sparsity=0.5, backend="cuda"), "backend"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bsr_linear(jnp.ones((4, 8)), jnp.ones((8, 2)), **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="x must have a floating dtype"):
        bsr_linear(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 2)), sparsity=0.5)
    with pytest.raises(ValueError, match="share a dtype"):
        bsr_linear(jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2)), sparsity=0.5)
    with pytest.raises(ValueError, match="expected x"):
        bsr_linear(jnp.ones((4, 8)), jnp.ones((7, 2)), sparsity=0.5)


def test_backend_environment_variable(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    assert backends.resolve_backend(None) == "reference"
    assert backends.resolve_backend("xla") == "xla"
    monkeypatch.setenv(backends.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="backend"):
        backends.resolve_backend(None)


@pytest.mark.parametrize("gather_bytes", [1, 3 * 8 * 24 * 4, 1 << 30])  # one column, groups of 3 of 6, all
def test_xla_column_path_matches_reference_in_column_groups(monkeypatch, gather_bytes):
    monkeypatch.setattr(xla_backend, "GATHER_BYTES", gather_bytes)
    monkeypatch.setattr(xla_backend, "BATCHED_MAX_KEPT", 1.0)
    monkeypatch.setattr(xla_backend, "BATCHED_MIN_BLOCK", 1)
    x, _, _ = _inputs((37, 45), 24, jnp.float32)
    dy = bf16_exact_normal(jax.random.key(3), (40, 24))
    bsr = from_dense(x, 0.5, 8, selection="column")
    assert bsr.column_count == 3
    chex.assert_trees_all_close(xla_backend.xla_dw(bsr, dy), backends.reference_dw(bsr, dy), atol=1e-5, rtol=1e-5)

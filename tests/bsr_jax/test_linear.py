"""bsr_linear on every backend and option against the independent float64 reference (tests/reference.py):
exact dx/db, masked dW; the forward rule that runs under jax.vjp is bitwise flax's Dense."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax import Dense, bsr_linear, from_dense, residual_bytes
from bsr_jax.backends import dispatch as backends
from bsr_jax.backends import xla as xla_backend

BACKENDS = ["reference", "xla", "xla-batched", "cpu", "pallas"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Every dW path: "xla-batched" forces the xla backend's batched column path, which it otherwise
    takes only at kept fractions these small test shapes do not reach; "pallas" runs interpreted."""
    if request.param == "xla-batched":
        monkeypatch.setattr(xla_backend, "BATCHED_MAX_KEPT", 1.0)
        monkeypatch.setattr(xla_backend, "BATCHED_MIN_BLOCK", 1)
        return "xla"
    return request.param


@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]  # of x; leading dims are flattened into M
    n: int
    dtype: jnp.dtype
    options: dict  # bsr_linear's pruning keywords besides sparsity=0.6
    values: str = "bf16-exact"  # "bf16-exact" | "float32" (not bf16-exact) | "heavy-tailed" | "ties"


CASES = {
    "l2-global-16": Case((4, 16, 48), 40, jnp.float32, dict(block=16)),
    "l1-column-8x4-padded-bf16": Case((3, 13, 37), 19, jnp.bfloat16, dict(block=(8, 4), criterion="l1", selection="column")),
    "l1-global-4x16": Case((40, 48), 24, jnp.float32, dict(block=(4, 16), criterion="l1")),
    "l2-column-tiny-2x3": Case((13, 11), 12, jnp.float32, dict(block=(2, 3), selection="column")),
    "ties-global-8": Case((32, 40), 16, jnp.float32, dict(block=8), values="ties"),
    "ties-l1-column-8": Case((32, 40), 16, jnp.float32, dict(block=8, criterion="l1", selection="column"), values="ties"),
    "bfloat16-storage": Case((40, 48), 24, jnp.float32, dict(block=8, storage_dtype="bfloat16"), values="float32"),
    "int8-storage-column-16": Case((48, 64), 20, jnp.float32, dict(block=16, selection="column", storage_dtype="int8"), values="float32"),
    "fp8-storage-8x16-bf16": Case((40, 48), 24, jnp.bfloat16, dict(block=(8, 16), storage_dtype="float8_e4m3fn")),
    "stochastic-l2-global": Case((40, 48), 24, jnp.float32, dict(block=8, stochastic=True), values="heavy-tailed"),
    "stochastic-l1-column-int8": Case((40, 48), 24, jnp.float32, dict(block=(4, 8), criterion="l1", selection="column", stochastic=True, storage_dtype="int8"), values="heavy-tailed"),  # fmt: skip
    "stochastic-l2-global-16-bf16": Case((64, 48), 24, jnp.bfloat16, dict(block=16, stochastic=True), values="heavy-tailed"),
}
SPARSITY = 0.6


def _case_inputs(case: Case, seed: int = 0):
    """x, w, b and the cotangent dy (bf16-representable except x for "float32"/"heavy-tailed")."""
    kx, kw, kb, kdy, ks = jax.random.split(jax.random.key(seed), 5)
    k, m = case.shape[-1], int(np.prod(case.shape[:-1]))
    if case.values == "ties":
        # +-1 entries: every block has the same L2 and L1 magnitude, so only the tie rule decides.
        x = jnp.where(jax.random.bernoulli(kx, 0.5, case.shape), 1.0, -1.0)
    elif case.values == "bf16-exact":
        x = bf16_exact_normal(kx, case.shape)
    else:  # full float32 mantissas, so bfloat16 storage really rounds
        x = jax.random.normal(kx, case.shape)
    if case.values == "heavy-tailed":
        # Block magnitudes spread over e^+-3, so many kept blocks lie above priority sampling's
        # threshold (rescale 1) and many below it (rescale > 1).
        block = case.options["block"]
        bm, bk = (block, block) if isinstance(block, int) else block
        scales = jnp.exp(1.5 * jax.random.normal(ks, (-(-m // bm), -(-k // bk))))
        x = x * jnp.repeat(jnp.repeat(scales, bm, 0), bk, 1)[:m, :k].reshape(case.shape)
    w = bf16_exact_normal(kw, (k, case.n)) * 0.25
    b = bf16_exact_normal(kb, (case.n,))
    dy = bf16_exact_normal(kdy, (*case.shape[:-1], case.n))
    return tuple(a.astype(case.dtype) for a in (x, w, b, dy))


def _kept(x, options, key, dtype):
    """The reference's kept (M, K) input for bsr_linear's options, keyed as the op keys from_dense."""
    x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    sampling = reference.op_sampling_key(key) if key is not None else None
    return reference.kept_input(x2, SPARSITY, options["block"], key=sampling, dtype=dtype, **_without(options, "block", "stochastic"))


def _without(options, *names):
    return {k: v for k, v in options.items() if k not in names}


@pytest.mark.parametrize("case", CASES)
def test_grads_match_independent_reference(backend, case):
    case = CASES[case]
    x, w, b, dy = _case_inputs(case)
    key = jax.random.key(7) if case.options.get("stochastic") else None
    layer = functools.partial(bsr_linear, sparsity=SPARSITY, backend=backend, key=key, **case.options)
    dx, dw, db = jax.jit(lambda x, w, b, dy: jax.vjp(layer, x, w, b)[1](dy))(x, w, b, dy)
    expected = reference.linear_grads(x, w, dy, _kept(x, case.options, key, case.dtype))
    assert dx.dtype == dw.dtype == db.dtype == case.dtype
    assert_close_scaled((dx, dw, db), tuple(jnp.asarray(e, jnp.float32) for e in expected), case.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sparsity", [0.0, 0.7])
def test_forward_and_input_grads_under_vjp_are_bitwise_flax_dense(dtype, sparsity):
    """y (the custom_vjp's forward rule, the one that runs under differentiation), dx and db equal
    nn.Dense's bit for bit; dW too at sparsity 0."""
    x = bf16_exact_normal(jax.random.key(0), (4, 16, 48), dtype)
    dy = bf16_exact_normal(jax.random.key(1), (4, 16, 40), dtype)
    ours, theirs = Dense(40, sparsity=sparsity, block=8, dtype=dtype), nn.Dense(40, dtype=dtype)
    params = theirs.init(jax.random.key(2), x)
    params = jax.tree.map(lambda p: p + bf16_exact_normal(jax.random.key(3), p.shape), params)  # non-zero bias

    def forward_and_grads(module):
        def run(params, x, dy):
            y, vjp = jax.vjp(lambda p, x: module.apply(p, x), params, x)
            return y, vjp(dy)

        return jax.jit(run)(params, x, dy)

    (y, (dparams, dx)), (y_ref, (dparams_ref, dx_ref)) = forward_and_grads(ours), forward_and_grads(theirs)
    chex.assert_trees_all_equal((y, dx, dparams["params"]["bias"]), (y_ref, dx_ref, dparams_ref["params"]["bias"]))
    if sparsity == 0.0:
        chex.assert_trees_all_equal(dparams, dparams_ref)
    else:
        assert not jnp.array_equal(dparams["params"]["kernel"], dparams_ref["params"]["kernel"])


def test_every_block_kept_gives_dense_dw(backend):
    """Each backend on a BlockSparse holding every block, against x.T @ dy in float64."""
    x = bf16_exact_normal(jax.random.key(0), (40, 48))
    dy = bf16_exact_normal(jax.random.key(9), (40, 24))
    bsr = from_dense(x, 0.0, (8, 16))
    dy_padded = jnp.pad(dy, ((0, bsr.padded_shape[0] - 40), (0, 0)))
    dw = jax.jit(backends.BACKENDS[backend])(bsr, dy_padded)[:48]
    expected = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    assert_close_scaled(dw, jnp.asarray(expected, jnp.float32), jnp.float32)


def test_residuals_hold_no_dense_copy_of_x():
    x = bf16_exact_normal(jax.random.key(0), (8, 64, 96))
    w, b = jnp.ones((96, 128)), jnp.ones((128,))
    f = jax.jit(lambda w, x: jnp.sum(jnp.sin(bsr_linear(x, w, b, sparsity=0.75, block=16))))
    res = residual_bytes(f, w, x)
    assert all(r.shape != x.shape and r.shape != (512, 96) for r in res.residuals)
    kept_values = int(0.25 * (512 // 16) * (96 // 16)) * 16 * 16 * 4
    indices = 48 * 2 + 7 * 4  # int16 block rows, int32 column pointer
    # Activations: kept blocks + indices + sin's saved cosine of the (8, 64, 128) output.
    assert res.activations == kept_values + indices + 8 * 64 * 128 * 4
    assert res.inputs == 0 and res.params == w.nbytes


def test_transformations_jit_vmap_scan_checkpoint_value_and_grad():
    x = bf16_exact_normal(jax.random.key(0), (6, 16, 32))
    w, b = bf16_exact_normal(jax.random.key(1), (32, 16)), bf16_exact_normal(jax.random.key(2), (16,))
    layer = functools.partial(bsr_linear, sparsity=0.5, block=8, backend="xla")
    loss = lambda w, x: jnp.sum(jnp.sin(layer(x, w, b)) * jnp.linspace(-1.0, 1.0, 16))
    # The references jitted (one compile each, not op-by-op dispatch): no vmap, scan or checkpoint in them.
    plain_grad = jax.jit(jax.grad(loss))
    per_example = jnp.stack([plain_grad(w, xi) for xi in x])
    chex.assert_trees_all_close(jax.jit(jax.vmap(jax.grad(loss), (None, 0)))(w, x), per_example, atol=1e-5, rtol=1e-5)

    def scanned(w, xs):
        return jax.lax.scan(lambda c, xi: (c + loss(w, xi), None), 0.0, xs)[0]

    chex.assert_trees_all_close(jax.jit(jax.grad(scanned))(w, x), per_example.sum(0), atol=1e-4, rtol=1e-5)
    value, grad = jax.jit(jax.value_and_grad(jax.checkpoint(loss)))(w, x)
    chex.assert_trees_all_close((value, grad), (jax.jit(loss)(w, x), plain_grad(w, x)), atol=1e-4, rtol=1e-5)


def test_nan_in_activations_reaches_dw_not_crash():
    x = bf16_exact_normal(jax.random.key(0), (32, 32)).at[3, 3].set(jnp.nan)
    w, b = jnp.ones((32, 8)), jnp.zeros((8,))
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
        (dict(sparsity=0.5, storage_dtype="float16"), "storage_dtype"),
        (dict(sparsity=0.5, backend="cuda"), "backend"),
        (dict(sparsity=0.5, key=jax.random.key(0)), "key is only used with stochastic=True"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bsr_linear(jnp.ones((4, 8)), jnp.ones((8, 2)), **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="x must have a floating dtype"):
        bsr_linear(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 2)), sparsity=0.5)
    with pytest.raises(ValueError, match="w must have a floating dtype"):
        bsr_linear(jnp.ones((4, 8)), jnp.ones((8, 2), jnp.int32), sparsity=0.5)
    with pytest.raises(ValueError, match="share a dtype"):
        bsr_linear(jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2)), sparsity=0.5)
    with pytest.raises(ValueError, match="expected x"):
        bsr_linear(jnp.ones((4, 8)), jnp.ones((7, 2)), sparsity=0.5)


def test_pallas_rejects_blocks_over_128():
    """Block sides are padded to powers of two for Triton; past 128 the kernel has no tiles."""
    x, w = jnp.ones((256, 8)), jnp.ones((8, 4))
    grad = jax.grad(lambda w: jnp.sum(bsr_linear(x, w, sparsity=0.5, block=(200, 8), backend="pallas")))
    with pytest.raises(ValueError, match=r"block sides must be powers of two in \(4, 8, 16, 32, 64, 128\)"):
        grad(w)


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
    x = bf16_exact_normal(jax.random.key(0), (37, 45))
    dy = bf16_exact_normal(jax.random.key(3), (40, 24))
    bsr = from_dense(x, 0.5, 8, selection="column")
    assert bsr.column_count == 3
    kept = reference.kept_input(np.asarray(x), 0.5, 8, selection="column")
    expected = kept.T @ np.asarray(dy, np.float64)[:37]
    assert_close_scaled(jax.jit(xla_backend.xla_dw)(bsr, dy)[:45], jnp.asarray(expected, jnp.float32), jnp.float32)

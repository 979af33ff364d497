import chex
import jax
import jax.numpy as jnp

import bsr_jax


def test_residual_bytes_classifies_params_inputs_activations():
    w = jnp.ones((16, 32))
    x = jnp.ones((8, 16))
    # jax.vjp of sin(x @ w) keeps w (for dx), x (for dw) and cos(x @ w) (for sin's derivative).
    res = bsr_jax.residual_bytes(lambda w, x: jnp.sum(jnp.sin(x @ w)), w, x)
    assert (res.params, res.inputs, res.activations) == (16 * 32 * 4, 8 * 16 * 4, 8 * 32 * 4)
    assert res.total == sum(r.nbytes for r in res.residuals)


def test_residual_bytes_counts_a_reused_array_once():
    w = jnp.ones((16, 16))
    x = jnp.ones((4, 16))
    res = bsr_jax.residual_bytes(lambda w, x: jnp.sum((x @ w) @ w), w, x)
    assert res.params == w.nbytes


def test_residual_bytes_runs_nothing_on_shape_structs():
    big = jax.ShapeDtypeStruct((1 << 16, 1 << 14), jnp.float32)  # 4 GiB: would not fit if allocated
    w = jax.ShapeDtypeStruct((1 << 14, 8), jnp.float32)
    res = bsr_jax.residual_bytes(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, big)
    assert res.inputs == 4 * 2**30


def test_dense_layer_sparse_residual_is_smaller_by_the_kept_fraction():
    x = jnp.ones((1024, 256))
    for sparsity, kept_blocks in [(0.5, 512), (0.75, 256)]:
        layer = bsr_jax.Dense(64, sparsity=sparsity, block=16)
        params = layer.init(jax.random.key(0), x)
        res = bsr_jax.residual_bytes(lambda p, x: jnp.sum(layer.apply(p, x)), params, x)
        assert res.inputs == 0
        assert res.activations == kept_blocks * (16 * 16 * 4 + 2) + (16 + 1) * 4  # int16 block rows


def test_compiled_memory_of_a_grad_step_grows_with_batch():
    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    small, large = (bsr_jax.compiled_memory(grad, w, jax.ShapeDtypeStruct((n, 128), jnp.float32)) for n in (256, 1024))
    assert small.arguments == (128 + 256) * 128 * 4 and small.outputs == 128 * 128 * 4
    assert small.temp >= 256 * 128 * 4  # at least the hidden activation kept for the backward pass
    assert large.temp > small.temp and small.aliased == 0
    # A donated w is aliased to the updated w: the report must see it, and the peak count it once.
    update = lambda w, x: w - 0.1 * grad(w, x)
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    plain, donated = bsr_jax.compiled_memory(update, w, x), bsr_jax.compiled_memory(jax.jit(update, donate_argnums=0), w, x)
    assert (plain.aliased, donated.aliased) == (0, 128 * 128 * 4)
    assert donated.peak <= plain.peak - 128 * 128 * 4 + abs(donated.temp - plain.temp)


N = 1024 * 4  # bytes of one f32 (1024,) array


def test_program_order_peak_of_a_chain():
    # x live throughout; sin's output and cos's output coexist while cos runs: 3 arrays.
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    assert bsr_jax.program_order_peak(lambda x: jnp.cos(jnp.sin(x)), x) == 3 * N


def test_program_order_peak_frees_after_last_use():
    # a=sin, b=cos, c=tanh, d=b*c (x, a, b, c, d live: 5), then b, c freed and e=a+d (x, a, d, e: 4).
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    assert bsr_jax.program_order_peak(lambda x: jnp.sin(x) + jnp.cos(x) * jnp.tanh(x), x) == 5 * N


def test_program_order_peak_counts_nested_jit_temporaries():
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    inner = jax.jit(lambda x: jnp.sin(x) + jnp.cos(x) * jnp.tanh(x))
    assert bsr_jax.program_order_peak(lambda x: inner(x) * 2.0, x) == 5 * N


def test_program_order_peak_of_grad_step_drops_with_sparsity():
    x = jax.ShapeDtypeStruct((2048, 256), jnp.float32)

    def peak(sparsity):
        # The reference backend's backward temporaries (one densified input) are known and small.
        layers = [bsr_jax.Dense(256, sparsity=sparsity, block=16, backend="reference") for _ in range(4)]

        def loss(params, x):
            for layer, p in zip(layers, params):
                # Checkpointed so tanh keeps its input, not its output (the next layer's input).
                x = jax.checkpoint(jnp.tanh)(layer.apply(p, x))
            return jnp.sum(x)

        params = [jax.eval_shape(layer.init, jax.random.key(0), x) for layer in layers]
        return bsr_jax.program_order_peak(jax.grad(loss), params, x), bsr_jax.residual_bytes(loss, params, x)

    (dense_peak, dense_res), (sparse_peak, sparse_res) = peak(0.0), peak(0.75)
    assert dense_peak >= dense_res.total  # every residual is live at the forward/backward boundary
    saved = dense_res.total - sparse_res.total
    assert saved > 0 and dense_peak - sparse_peak >= 0.5 * saved


def test_remat_policy_keeps_blocks_and_dots_and_recomputes_elementwise():
    x = jnp.ones((1024, 256))
    ws = (jnp.ones((256, 1024)), jnp.ones((1024, 256)))

    def block(ws, x):
        h = jax.nn.gelu(bsr_jax.bsr_linear(x, ws[0], sparsity=0.75, block=16), approximate=False)
        return x + bsr_jax.bsr_linear(h, ws[1], sparsity=0.75, block=16)

    def activations(f):
        return bsr_jax.residual_bytes(lambda ws, x: jnp.sum(f(ws, x)), ws, x).activations

    blocks = 256 * (16 * 16 * 4 + 2) + 17 * 4 + 1024 * (16 * 16 * 4 + 2) + 65 * 4
    gelu_input = 1024 * 1024 * 4  # the first dot's output
    assert activations(jax.checkpoint(block, policy=bsr_jax.remat_policy())) == blocks + gelu_input
    assert activations(block) > blocks + 2 * gelu_input  # plain: GELU keeps temporaries too
    grads = jax.jit(jax.grad(lambda ws: jnp.sum(block(ws, x))))(ws)
    remat_grads = jax.jit(jax.grad(lambda ws: jnp.sum(jax.checkpoint(block, policy=bsr_jax.remat_policy())(ws, x))))(ws)
    chex.assert_trees_all_close(remat_grads, grads, rtol=1e-6)


def test_residual_bytes_counts_typed_prng_keys():
    # A residual holding a typed key (e.g. a dropout key kept for the backward pass) is counted by
    # its own itemsize (8 bytes for threefry), not looked up as a numpy dtype.
    key = jax.random.key(0)
    f = lambda w, key: jnp.sum(w * jax.lax.stop_gradient(jax.random.uniform(key, w.shape)))  # noqa: E731
    keep_key = jax.checkpoint(f)  # recomputes the draw in the backward pass: the key is kept
    res = bsr_jax.residual_bytes(keep_key, jnp.ones(4), key)
    assert any(r.dtype.startswith("key<") and r.nbytes == 8 for r in res.residuals)

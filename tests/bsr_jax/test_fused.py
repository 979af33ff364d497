"""``backend="fused"``: the forward GEMM writes x's int8 / int4 codes (1 x 128 blocks), the dW GEMM
reads them (``bsr_jax.backends.fused``; kernels interpreted on this CPU).

References: the ``xla`` backend on the same residual (the same codes, so the same dW up to f32
summation order), ``jax.grad`` of the dense layer (y to f32 rounding, dx exact), and the compiled
H100 program's own text and peak."""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from numerics import assert_close_scaled, bf16_exact_normal

import bsr_jax
from bsr_jax import Pruning
from bsr_jax.backends import fused
from pallas_kernels import quantized_matmul_tpu

ROWS = {s: Pruning(0.0, block=(1, 128), storage_dtype=s) for s in ("int8", "int4")}


def _grads(x, w, pruning, backend):
    # Linear in y, so dy does not depend on y's rounding and dx is comparable bit for bit.
    weights = jax.random.normal(jax.random.key(2), (*x.shape[:-1], w.shape[1]))

    def loss(x, w):
        y = bsr_jax.bsr_linear(x, w, pruning=pruning, backend=backend)
        return jnp.sum(y.astype(jnp.float32) * weights), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, dx, dw


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("storage,k", [("int8", 256), ("int4", 256), ("int8", 64)])
def test_fused_gives_the_unfused_gradients_and_the_dense_forward(storage, k, dtype):
    x = bf16_exact_normal(jax.random.key(0), (2, 24, k), dtype)  # (2, 24, K): leading axes flattened to 48 rows
    w = bf16_exact_normal(jax.random.key(1), (k, 48), dtype) * 0.1
    pruning = ROWS[storage]
    assert fused.why_not(pruning, x.reshape(48, k), w) is None
    y, dx, dw = _grads(x, w, pruning, "fused")
    y_xla, dx_xla, dw_xla = _grads(x, w, pruning, "xla")
    chex.assert_trees_all_equal(dx, dx_xla)  # dx = dy @ w.T either way: the same XLA product
    assert_close_scaled(y, y_xla, dtype)  # the kernel's own f32 accumulation order
    # The same codes, summed in another order (int4 in f32: products in bf16, fused.DW_PRODUCTS).
    assert_close_scaled(dw, dw_xla, fused.DW_PRODUCTS.get((storage, jnp.dtype(dtype)), dtype))
    weights = jax.random.normal(jax.random.key(2), (*x.shape[:-1], w.shape[1]))
    dense_dx, dense_dw = jax.grad(lambda x, w: jnp.sum((x @ w).astype(jnp.float32) * weights), argnums=(0, 1))(x, w)
    assert_close_scaled(dx, dense_dx, dtype)
    error = jnp.linalg.norm((dw - dense_dw).astype(jnp.float32)) / jnp.linalg.norm(dense_dw.astype(jnp.float32))
    assert error < {"int8": 0.02, "int4": 0.25}[storage]  # the format's bound (Pruning's docstring)


def test_layers_the_kernels_do_not_take_run_the_unfused_path():
    x = bf16_exact_normal(jax.random.key(0), (48, 96), jnp.float32)  # K = 96: clamped 1 x 96 blocks, not a power of two
    w = bf16_exact_normal(jax.random.key(1), (96, 32), jnp.float32)
    assert "tile must be a power of two" in fused.why_not(ROWS["int8"], x, w)
    assert "block (1, 128)" in fused.why_not(Pruning(0.0, block=16, storage_dtype="int8"), x, w)
    assert "jnp.int4" in fused.why_not(ROWS["int4"], x[:, :64], w[:64])  # one tile per row: stored as token rows
    chex.assert_trees_all_equal(_grads(x, w, ROWS["int8"], "fused"), _grads(x, w, ROWS["int8"], "xla"))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: bsr_jax.bsr_linear(x, w, pruning=ROWS["int8"], backend="fused").sum()))(x, w))
    assert "matmul_quantizing" not in jaxpr and "quantized_t_matmul" not in jaxpr


def _dw_kernel_dy_dtypes(pruning, dtype) -> set:
    """The dtypes of dy as the dW kernels (Pallas calls reading integer codes) of a gradient take it."""
    x = bf16_exact_normal(jax.random.key(0), (64, 256), dtype)
    w = bf16_exact_normal(jax.random.key(1), (256, 32), dtype)
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(bsr_jax.bsr_linear(x, w, pruning=pruning, backend="fused") ** 2)))(w)
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            dtypes = [v.aval.dtype for v in eqn.invars]
            if eqn.primitive.name == "pallas_call" and jnp.issubdtype(dtypes[0], jnp.integer):
                found.add(dtypes[-1])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("storage, dy_dtype", [("int4", jnp.bfloat16), ("int8", jnp.float32)])
def test_float32_int4_layers_take_dw_products_in_bf16_and_stay_within_its_rounding(storage, dy_dtype):
    """int4's codes are 0.12 from dense's dW; bf16 products move it by 0.0024 (fused.DW_PRODUCTS).
    int8 (0.006 from dense) keeps f32 products: the same dW as the unfused path's to f32 rounding."""
    assert _dw_kernel_dy_dtypes(ROWS[storage], jnp.float32) == {jnp.dtype(dy_dtype)}
    x = jax.random.normal(jax.random.key(3), (256, 256), jnp.float32)
    w = jax.random.normal(jax.random.key(4), (256, 96), jnp.float32) * 0.1
    dw, unfused = _grads(x, w, ROWS[storage], "fused")[2], _grads(x, w, ROWS[storage], "xla")[2]
    dense = jax.grad(lambda w: jnp.sum((x @ w) * jax.random.normal(jax.random.key(2), (256, 96))))(w)
    moved, format_error = (float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in ((dw, unfused), (unfused, dense)))
    assert moved < {"int4": 0.005, "int8": 1e-5}[storage] and moved < format_error / 20, (moved, format_error)


def _step(backend, pruning):
    def loss(x, w1, w2):
        h = jax.nn.gelu(bsr_jax.bsr_linear(x, w1, pruning=pruning, backend=backend))
        return jnp.sum(bsr_jax.bsr_linear(h, w2, pruning=pruning, backend=backend).astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(1, 2))


def test_compiled_for_h100_the_kernels_write_and_read_the_codes():
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((512, 256), (256, 512), (512, 256))]
    fused_step = bsr_jax.compiled_memory(_step("fused", ROWS["int4"]), *shapes, target="h100", breakdown=True)
    unfused = bsr_jax.compiled_memory(_step("pallas", ROWS["int4"]), *shapes, target="h100")
    ops = [k.op for k in fused_step.kernels]
    assert any(op.endswith("matmul_quantizing/pallas_call") for op in ops)
    assert any(op.endswith("quantized_t_matmul/pallas_call") for op in ops)
    assert fused_step.peak <= unfused.peak  # the same residual: no byte more to keep


def test_lowered_for_tpu_int8_runs_the_mosaic_kernels_and_int4_the_unfused_path():
    x, w1, w2 = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((512, 256), (256, 512), (512, 256)))
    text = jax.jit(_step("fused", ROWS["int8"])).trace(x, w1, w2).lower(lowering_platforms=("tpu",)).as_text()
    assert "triton" not in text and text.count("matmul_quantizing_tpu") == 2 and text.count("quantized_t_matmul_tpu") == 2
    text = jax.jit(_step("fused", ROWS["int4"])).trace(x, w1, w2).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in text and "matmul_quantizing" not in text  # int4 on TPU: XLA's passes, the same codes


def test_on_tpu_the_kernels_keep_what_the_unfused_path_keeps_and_xla_times_the_step():
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1024, 256), (256, 512), (512, 256))]
    fused_step = bsr_jax.compiled_memory(_step("fused", ROWS["int8"]), *shapes, target="tpu-v5p")
    unfused = bsr_jax.compiled_memory(_step("xla", ROWS["int8"]), *shapes, target="tpu-v5p")
    assert fused_step.optimal_seconds is not None and fused_step.peak <= unfused.peak


class _SharedInput(nn.Module):
    """q, k and v read one input; fc reads its own (as a transformer block's MLP does)."""

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(256, name=name)(x) for name in ("q", "k", "v"))
        return nn.Dense(256, name="fc")(jax.nn.gelu(q * k + v))


def test_through_compress_model_a_layer_reading_its_input_alone_writes_its_own_codes():
    # compress_model compresses an input once for all the layers reading it; a layer whose GEMM
    # writes the codes itself needs no such pass: its first reader keeps its own, the rest share.
    model = _SharedInput()
    x = bf16_exact_normal(jax.random.key(0), (256, 256), jnp.bfloat16)
    params = model.init(jax.random.key(1), x)

    def grads(backend):
        compressed = bsr_jax.compress_model(model, [bsr_jax.Rule("*", dataclasses.replace(ROWS["int8"], backend=backend))], lean=False)
        return jax.grad(lambda p, x: jnp.sum(compressed.apply(p, x).astype(jnp.float32) ** 2))

    text = jax.jit(grads("fused")).trace(params, x).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("matmul_quantizing_tpu") == 2  # q (k and v share one compression of x) and fc
    assert text.count("quantized_t_matmul_tpu") == 4
    fused_grads, xla_grads = jax.jit(grads("fused"))(params, x), jax.jit(grads("xla"))(params, x)
    chex.assert_trees_all_close(fused_grads, xla_grads, rtol=0.05, atol=0.05)  # the same codes; y in the kernel's f32 order, in bf16


def test_on_tpu_a_forward_gemm_that_would_reread_w_too_often_is_left_to_xla():
    # f32, N 2048: 256 rows a program fit VMEM, so w would be read 4 times for 1024 rows (3 re-reads
    # of 2048 columns = 6 reads of x): XLA's dot and passes write the codes, the dW kernel reads them.
    x, w = jax.ShapeDtypeStruct((1024, 256), jnp.float32), jax.ShapeDtypeStruct((256, 2048), jnp.float32)
    assert quantized_matmul_tpu.weight_rereads(1024, 256, 2048, 128, 4) > fused.REREADS
    grad = jax.grad(lambda x, w: jnp.sum(bsr_jax.bsr_linear(x, w, pruning=ROWS["int8"], backend="fused") ** 2), argnums=1)
    text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    assert "matmul_quantizing_tpu" not in text and text.count("quantized_t_matmul_tpu") == 1

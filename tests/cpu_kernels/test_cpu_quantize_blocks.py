"""cpu_kernels.quantize_blocks (the C++ FFI kernel that stores every block of x in int8 / int4), on
every instruction-set path this CPU has, bitwise against the jitted jax.numpy reference
(bsr_jax.storage.quantize.quantize_blocks of x's blocks in block-column-major order)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from bsr_jax import from_dense
from bsr_jax.storage.quantize import dequantize_blocks, quantize_blocks

ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in cpu_kernels.supported_isas(), reason=f"this CPU lacks {isa}"))
    for isa in cpu_kernels.ISAS
]
# (x's shape, block): whole blocks; padding on both sides; odd bm * bk (int4's last high nibble is
# padding); one block covering x; 1x1 blocks; a wide x split between threads by block-row.
SHAPES = {
    "whole blocks": ((64, 48), (16, 16)),
    "padded rows and columns": ((37, 29), (16, 16)),
    "odd block 3x5": ((33, 10), (3, 5)),
    "one block": ((5, 7), (5, 7)),
    "1x1 blocks": ((6, 4), (1, 1)),
    "many block-rows": ((1024, 96), (16, 16)),
}


def reference(x: jax.Array, block: tuple[int, int], storage_dtype: str, jit: bool = True):
    (m, k), (bm, bk) = x.shape, block
    mb, kb = -(-m // bm), -(-k // bk)
    blocks = jnp.pad(x, ((0, mb * bm - m), (0, kb * bk - k))).reshape(mb, bm, kb, bk).transpose(2, 0, 1, 3)
    quantize = jax.jit(quantize_blocks, static_argnums=1) if jit else quantize_blocks
    return quantize(blocks.reshape(kb * mb, bm, bk), storage_dtype)


def kernel(x, block, storage_dtype, isa):
    return jax.jit(lambda x: cpu_kernels.quantize_blocks(x, block, storage_dtype, isa=isa))(x)


LIMITS = {"int4": 7.0, "int8": 127.0}


def special_values(shape: tuple[int, int], storage_dtype: str, seed: int = 0) -> jax.Array:
    """Normal values, an all-zero band and a denormal, and in the first block-row exact ties: with
    max |v| = the format's limit the scale is exactly 1 (limit * (1 / limit) rounds to 1 in f32),
    so halves in row 0 round half to even (2.5 -> 2, -3.5 -> -4)."""
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 3
    x[0, :] = (np.arange(shape[1]) % 15 - 7) * 0.5
    x[1 % shape[0], :] = np.where(np.arange(shape[1]) % 4 == 0, LIMITS[storage_dtype], 0.5)
    x[shape[0] // 2 :, : shape[1] // 3] = 0.0
    x[-1, -1] = 1e-44
    return jnp.asarray(x)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage_dtype", ["int4", "int8"])
@pytest.mark.parametrize("case", SHAPES)
def test_bitwise_equal_to_the_jitted_reference(case, storage_dtype, isa):
    shape, block = SHAPES[case]
    x = special_values(shape, storage_dtype)
    got = kernel(x, block, storage_dtype, isa)
    chex.assert_trees_all_equal(got, reference(x, block, storage_dtype))
    # Eager jax.numpy (one op at a time: nothing for XLA to rewrite) agrees too.
    chex.assert_trees_all_equal(got, reference(x, block, storage_dtype, jit=False))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage_dtype", ["int4", "int8"])
def test_bfloat16_input_is_read_as_its_float32_value(storage_dtype, isa):
    x = special_values((40, 50), storage_dtype, seed=1).astype(jnp.bfloat16)
    chex.assert_trees_all_equal(kernel(x, (16, 16), storage_dtype, isa), reference(x.astype(jnp.float32), (16, 16), storage_dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("storage_dtype", ["int4", "int8"])
def test_nan_and_inf_blocks_get_nan_scales_and_zero_values(storage_dtype, isa):
    """The documented rule (bsr_jax.storage.quantize): a block holding NaN or inf has a NaN scale, so its
    NaN reaches dW; its stored values are 0. Every other block is as the reference stores it."""
    x = special_values((48, 48), storage_dtype, seed=2)
    poisoned = x.at[3, 5].set(jnp.nan).at[40, 33].set(-jnp.inf)  # blocks (0, 0) and (2, 2)
    stored, scales = kernel(poisoned, (16, 16), storage_dtype, isa)
    want_stored, want_scales = reference(x, (16, 16), storage_dtype)
    bad = np.zeros(9, bool)
    bad[[0 * 3 + 0, 2 * 3 + 2]] = True  # slot j * Mb + i
    assert np.array_equal(np.isnan(np.asarray(scales)), bad)
    assert not np.any(np.asarray(stored)[bad])
    chex.assert_trees_all_equal(stored[~bad], want_stored[~bad])
    chex.assert_trees_all_equal(scales[~bad], want_scales[~bad])
    block = (16, 16)
    decoded = dequantize_blocks(stored, scales, storage_dtype, block, jnp.float32)
    assert np.all(np.isnan(np.asarray(decoded)[bad])) and np.all(np.isfinite(np.asarray(decoded)[~bad]))


@pytest.mark.parametrize("isa", ISAS)
def test_threads_do_not_change_the_result(isa):
    x = special_values((4096, 64), "int4", seed=3)
    call = jax.jit(lambda x: cpu_kernels.quantize_blocks(x, (16, 16), "int4", isa=isa))
    chex.assert_trees_all_equal(call(x), call(x), reference(x, (16, 16), "int4"))


def test_from_dense_at_sparsity_0_calls_the_kernel_on_cpu_only():
    x = special_values((70, 40), "int4", seed=4)
    compress = lambda x: from_dense(x, 0.0, 16, storage_dtype="int4")  # noqa: E731
    texts = {p: jax.jit(compress).trace(x).lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda", "tpu")}
    assert cpu_kernels.QUANTIZE_TARGET in texts["cpu"]
    assert cpu_kernels.QUANTIZE_TARGET not in texts["cuda"] and cpu_kernels.QUANTIZE_TARGET not in texts["tpu"]
    bsr = jax.jit(compress)(x)
    chex.assert_trees_all_equal((bsr.values, bsr.scales), reference(x, (16, 16), "int4"))
    # Stochastic rounding stays on the jax.numpy path.
    text = jax.jit(lambda x, k: from_dense(x, 0.0, 16, storage_dtype="int4", rounding_key=k)).trace(x, jax.random.key(0))
    assert cpu_kernels.QUANTIZE_TARGET not in text.lower().as_text()


@pytest.mark.parametrize(
    "x,block,storage_dtype,match",
    [
        (jnp.zeros((4, 4)), (2, 2), "float8_e4m3fn", "storage_dtype must be one of"),
        (jnp.zeros((4, 4), jnp.float16), (2, 2), "int4", "float32 or bfloat16"),
        (jnp.zeros((4,)), (2, 2), "int4", r"\(M, K\)"),
        (jnp.zeros((4, 4)), (8, 2), "int4", "within x's shape"),
    ],
)
def test_bad_arguments_raise_naming_them(x, block, storage_dtype, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.quantize_blocks(x, block, storage_dtype)

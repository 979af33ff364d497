"""cpu_kernels.bsr_t_matmul (the C++ FFI kernel), on every instruction-set path this CPU has and
every stored value type, against the pure-jax reference of the dequantized blocks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_cases import ONE_BLOCK, SEVERAL_WITH_EMPTY_COLUMN, dense_operand, kept_blocks, random_mask

import cpu_kernels
from bsr_jax import from_dense
from bsr_jax.backends import dispatch as backends
from bsr_jax.storage.quantize import dequantize_blocks, quantize_blocks
from pallas_kernels import bsr_t_matmul_reference

# A path the CPU lacks would die on an illegal instruction: skip it, saying so.
ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in cpu_kernels.supported_isas(), reason=f"this CPU lacks {isa}"))
    for isa in cpu_kernels.ISAS
]
STORED = ["float32", "bfloat16", "int8", "int4"]

# (keep mask, block, N): capacity 1, an empty column, every block kept; N covers whole tiles (64
# for AVX-512, 96 for AVX2), whole register steps, single vectors and a scalar tail; bk covers
# whole 4-row groups and a remainder; odd bm * bk leaves int4's last high nibble as padding.
CASES = {
    "one block": (ONE_BLOCK, (16, 16), 40),
    "several, empty column": (SEVERAL_WITH_EMPTY_COLUMN, (16, 16), 200),
    "all kept, non-square": (np.ones((2, 3), bool), (32, 16), 64),
    "block 8x4": (random_mask((5, 6), 0.5, seed=3), (8, 4), 20),
    "block 3x5, odd sides": (random_mask((7, 5), 0.4, seed=4), (3, 5), 129),
    "block 64, two tiles": (random_mask((4, 3), 0.5, seed=5), (64, 64), 200),
    "block 1x1, many panels": (random_mask((130, 7), 0.3, seed=6), (1, 1), 17),
}
# f32 sums of O(1) products differ from the reference only by their order.
TOLERANCE = dict(atol=1e-4, rtol=1e-5)


def stored_operands(values: jax.Array, stored: str) -> tuple[dict, jax.Array]:
    """The kernel's keyword arguments for blocks stored as ``stored``, and the f32 blocks they decode to."""
    if stored == "float32":
        return dict(values=values), values
    if stored == "bfloat16":
        values = values.astype(jnp.bfloat16)
        return dict(values=values), values.astype(jnp.float32)
    q, scales = quantize_blocks(values, stored)
    block = values.shape[1:]
    kwargs = dict(values=q, scales=scales, block=tuple(block) if stored == "int4" else None)
    return kwargs, dequantize_blocks(q, scales, stored, block, jnp.float32)


def run(kwargs: dict, row_ids, col_ptr, dy, isa: str) -> jax.Array:
    values = kwargs.pop("values")
    return cpu_kernels.bsr_t_matmul(values, row_ids, col_ptr, dy, isa=isa, **kwargs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("stored", STORED)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_of_dequantized_blocks(case, stored, isa):
    mask, block, n = CASES[case]
    kept = kept_blocks(mask, block, jnp.float32)
    dy = dense_operand(kept.masked_x.shape[0], n, jnp.float32)
    kwargs, decoded = stored_operands(kept.values, stored)
    out = run(kwargs, kept.row_ids, kept.col_ptr, dy, isa)
    assert out.shape == (kept.masked_x.shape[1], n) and out.dtype == jnp.float32
    chex.assert_trees_all_close(out, bsr_t_matmul_reference(decoded, kept.row_ids, kept.col_ptr, dy), **TOLERANCE)


@pytest.mark.parametrize("isa", ISAS)
def test_zero_capacity_unused_slots_and_nan_scales(isa):
    kept = kept_blocks(SEVERAL_WITH_EMPTY_COLUMN, (16, 16), jnp.float32)
    dy = dense_operand(48, 100, jnp.float32)
    # Slots past col_ptr[-1] are unused: NaN values and out-of-range rows there are never read.
    values = jnp.concatenate([kept.values, jnp.full((2, 16, 16), jnp.nan)])
    row_ids = jnp.concatenate([kept.row_ids, jnp.full((2,), 99, jnp.int32)])
    out = cpu_kernels.bsr_t_matmul(values, row_ids, kept.col_ptr, dy, isa=isa)
    chex.assert_trees_all_close(out, bsr_t_matmul_reference(kept.values, kept.row_ids, kept.col_ptr, dy), **TOLERANCE)
    assert jnp.all(out[16:32] == 0.0)
    empty = cpu_kernels.bsr_t_matmul(jnp.zeros((0, 16, 16)), jnp.zeros((0,), jnp.int32), jnp.zeros((4,), jnp.int32), dy, isa=isa)
    chex.assert_trees_all_equal(empty, jnp.zeros((48, 100), jnp.float32))
    # A NaN scale (a block that held NaN or inf) reaches exactly its block-column's rows of dW.
    q, scales = quantize_blocks(kept.values, "int8")
    out = cpu_kernels.bsr_t_matmul(q, kept.row_ids, kept.col_ptr, dy, scales=scales.at[0].set(jnp.nan), isa=isa)
    assert jnp.all(jnp.isnan(out[:16])) and not jnp.any(jnp.isnan(out[16:]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("stored", ["float32", "int4"])
def test_multithreaded_result_is_deterministic(isa, stored):
    """Each output tile has one writer, so two runs (tiles possibly on other threads) are bitwise equal."""
    x = dense_operand(512, 96, jnp.float32)
    bsr = from_dense(x, 0.7, 16)
    dy = dense_operand(512, 640, jnp.float32, seed=2)
    kwargs, decoded = stored_operands(bsr.values, stored)
    call = jax.jit(lambda: run(dict(kwargs), bsr.row_ids, bsr.col_ptr, dy, isa))
    chex.assert_trees_all_equal(call(), call())
    chex.assert_trees_all_close(call(), bsr_t_matmul_reference(decoded, bsr.row_ids, bsr.col_ptr, dy), **TOLERANCE)


def test_bad_row_id_fails_naming_the_slot():
    kept = kept_blocks(SEVERAL_WITH_EMPTY_COLUMN, (16, 16), jnp.float32)
    dy = dense_operand(48, 32, jnp.float32)
    with pytest.raises(Exception, match=r"row_ids\[2\] = 3 outside \[0, 3\)"):
        cpu_kernels.bsr_t_matmul(kept.values, kept.row_ids.at[2].set(3), kept.col_ptr, dy).block_until_ready()


@pytest.mark.parametrize(
    "values,kwargs,dy_rows,match",
    [
        (jnp.zeros((2, 16)), {}, 32, r"values must be \(cap, bm, bk\)"),
        (jnp.zeros((2, 16, 16)), {}, 40, "whole number of 16-row blocks"),
        (jnp.zeros((2, 16, 16), jnp.int8), {}, 32, "scales must be"),
        (jnp.zeros((2, 16, 16)), dict(scales=jnp.ones(2)), 32, "scales must be"),
        (jnp.zeros((2, 128), jnp.uint8), dict(scales=jnp.ones(2)), 32, "packed int4 values"),
        (jnp.zeros((2, 100), jnp.uint8), dict(scales=jnp.ones(2), block=(16, 16)), 32, "packed int4 values"),
        (jnp.zeros((2, 16, 16)), dict(isa="sse9"), 32, "isa must be one of"),
    ],
)
def test_bad_arguments_raise_naming_them(values, kwargs, dy_rows, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.bsr_t_matmul(values, jnp.zeros((2,), jnp.int32), jnp.array([0, 2]), jnp.zeros((dy_rows, 8)), **kwargs)


def test_isa_from_environment_and_unsupported_paths(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert cpu_kernels.resolve_isa() == cpu_kernels.supported_isas()[-1]
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "portable")
    assert cpu_kernels.resolve_isa() == "portable" and cpu_kernels.resolve_isa("avx2" if "avx2" in cpu_kernels.supported_isas() else "portable")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match=f"{cpu_kernels.ISA_ENV} must be one of"):
        cpu_kernels.resolve_isa()
    monkeypatch.setattr(cpu_kernels, "supported_isas", lambda: ("portable",))
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=f"{cpu_kernels.ISA_ENV}='avx512': this CPU supports only"):
        cpu_kernels.resolve_isa()


def test_detected_paths_match_cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags on this system")
    assert cpu_kernels.supported_isas()[0] == "portable"
    assert ("avx2" in cpu_kernels.supported_isas()) == ({"avx2", "fma"} <= flags)
    assert ("avx512" in cpu_kernels.supported_isas()) == ({"avx2", "fma", "avx512f"} <= flags)


@pytest.mark.parametrize("stored", ["float32", "int8"])
def test_inside_shard_map_with_operands_varying_differently(stored):
    """Under shard_map the per-shard blocks vary over the mesh axis while a column-selection col_ptr
    (an iota) does not; the call must still trace, run and match the per-shard reference."""
    mesh = jax.make_mesh((1,), ("data",))
    x = dense_operand(64, 48, jnp.float32)
    dy = dense_operand(64, 40, jnp.float32, seed=2)
    storage_dtype = None if stored == "float32" else stored

    def local(x, dy):
        bsr = from_dense(x, 0.5, 16, selection="column", storage_dtype=storage_dtype)
        out = cpu_kernels.bsr_t_matmul(bsr.values, bsr.block_rows, bsr.col_ptr, dy, scales=bsr.scales)
        return out, backends.reference_dw(bsr, dy)

    spec = jax.sharding.PartitionSpec("data")
    x, dy = jax.device_put((x, dy), jax.sharding.NamedSharding(mesh, spec))
    out, expected = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(x, dy)
    chex.assert_trees_all_close(out, expected, **TOLERANCE)

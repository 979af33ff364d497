import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bsr_jax.storage.format import BlockSparse, capacity_for, from_dense


def _block_mags(x: np.ndarray, block, criterion) -> np.ndarray:
    """Independent numpy block magnitudes over the zero-padded x, shape (Mb, Kb)."""
    bm, bk = block
    mb, kb = -(-x.shape[0] // bm), -(-x.shape[1] // bk)
    xp = np.zeros((mb * bm, kb * bk), np.float64)
    xp[: x.shape[0], : x.shape[1]] = x
    blocks = xp.reshape(mb, bm, kb, bk)
    return (blocks**2).sum((1, 3)) if criterion == "l2" else np.abs(blocks).sum((1, 3))


def _kept_set(bsr: BlockSparse) -> set[tuple[int, int]]:
    return set(zip(np.asarray(bsr.row_ids).tolist(), np.asarray(bsr.col_ids).tolist()))


@pytest.mark.parametrize("criterion", ["l2", "l1"])
@pytest.mark.parametrize("shape,block", [((64, 48), (16, 16)), ((37, 21), (8, 4)), ((5, 3), (4, 4))])
def test_global_selection_keeps_topk_blocks(criterion, shape, block):
    x = np.asarray(jax.random.normal(jax.random.key(1), shape))
    bsr = from_dense(jnp.asarray(x), 0.6, block, criterion=criterion)
    mags = _block_mags(x, block, criterion)
    assert bsr.capacity == capacity_for(mags.shape, 0.6)
    top = np.argsort(-mags.ravel(), kind="stable")[: bsr.capacity]
    assert _kept_set(bsr) == {divmod(int(i), mags.shape[1]) for i in top}


def test_column_selection_keeps_topk_per_column():
    x = np.asarray(jax.random.normal(jax.random.key(2), (100, 40)))
    bsr = from_dense(jnp.asarray(x), 0.7, (10, 8), selection="column")
    mags = _block_mags(x, (10, 8), "l2")
    per_col = int(np.ceil(0.3 * 10))
    np.testing.assert_array_equal(np.diff(np.asarray(bsr.col_ptr)), per_col)
    expected = {(int(r), c) for c in range(mags.shape[1]) for r in np.argsort(-mags[:, c])[:per_col]}
    assert _kept_set(bsr) == expected


@pytest.mark.parametrize("selection", ["global", "column"])
def test_layout_grouped_by_column_rows_ascending(selection):
    x = jax.random.normal(jax.random.key(3), (96, 80))
    bsr = from_dense(x, 0.5, 16, selection=selection)
    rows, cols, ptr = map(np.asarray, (bsr.row_ids, bsr.col_ids, bsr.col_ptr))
    assert bsr.block_rows.dtype == np.int16
    assert ptr[0] == 0 and ptr[-1] == bsr.capacity and np.all(np.diff(ptr) >= 0)
    for j in range(bsr.grid[1]):
        assert np.all(cols[ptr[j] : ptr[j + 1]] == j)
        assert np.all(np.diff(rows[ptr[j] : ptr[j + 1]]) > 0)
    assert rows.dtype == cols.dtype == ptr.dtype == np.int32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_to_dense_is_masked_input(dtype):
    x = jax.random.normal(jax.random.key(4), (45, 30)).astype(dtype)
    bsr = jax.jit(lambda x: from_dense(x, 0.5, (8, 16)))(x)
    dense = bsr.to_dense()
    assert dense.dtype == dtype and dense.shape == x.shape
    kept = np.zeros(bsr.grid, bool)
    kept[np.asarray(bsr.row_ids), np.asarray(bsr.col_ids)] = True
    mask = np.kron(kept, np.ones((8, 16), bool))[:45, :30]
    chex.assert_trees_all_equal(dense, jnp.where(mask, x, 0).astype(dtype))


def test_sparsity_zero_keeps_everything_and_padding_is_zero():
    x = jax.random.normal(jax.random.key(5), (13, 7))
    bsr = from_dense(x, 0.0, 4)
    assert bsr.capacity == 4 * 2
    chex.assert_trees_all_equal(bsr.to_dense(), x)
    padded = bsr.to_dense(padded=True)
    assert padded.shape == (16, 8) and not jnp.any(padded[13:]) and not jnp.any(padded[:, 7:])


def test_high_sparsity_keeps_one_block_and_padding_ranks_last():
    x = jnp.ones((10, 10))  # with block 8 three of four blocks are partly padding
    bsr = from_dense(x, 0.99, 8)
    assert bsr.capacity == 1
    assert _kept_set(bsr) == {(0, 0)}


def test_capacity_rounding_is_exact_for_decimal_sparsity():
    assert capacity_for((10, 10), 0.7) == 30
    assert capacity_for((10, 10), 0.7, "column") == 30
    assert capacity_for((7, 3), 0.5, "column") == 4 * 3


def test_nbytes_counts_values_and_indices():
    bsr = from_dense(jnp.ones((64, 64), jnp.bfloat16), 0.75, 16)
    assert bsr.block_rows.dtype == jnp.int16
    assert bsr.nbytes == 4 * 16 * 16 * 2 + 4 * 2 + (4 + 1) * 4


def test_row_ids_switch_to_int32_past_int16_range():
    x = jax.ShapeDtypeStruct((32769, 1), jnp.float32)
    assert jax.eval_shape(lambda x: from_dense(x, 0.5, 1), x).block_rows.dtype == jnp.int32
    x = jax.ShapeDtypeStruct((32768, 1), jnp.float32)
    assert jax.eval_shape(lambda x: from_dense(x, 0.5, 1), x).block_rows.dtype == jnp.int16


def test_nan_block_is_kept_and_does_not_crash():
    x = jnp.zeros((32, 32)).at[20, 5].set(jnp.nan).at[3, 30].set(5.0)
    bsr = jax.jit(lambda x: from_dense(x, 0.5, 16))(x)
    assert {(1, 0), (0, 1)} == _kept_set(bsr)
    assert jnp.isnan(bsr.to_dense()[20, 5])


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, float("nan"), "0.5", True])
def test_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match="sparsity"):
        from_dense(jnp.ones((8, 8)), sparsity, 4)


@pytest.mark.parametrize("block", [0, -4, (4,), (4, 0), (2.0, 2), True])
def test_bad_block(block):
    with pytest.raises(ValueError, match="block"):
        from_dense(jnp.ones((8, 8)), 0.5, block)


def test_bad_input_dtype_rank_criterion_selection():
    with pytest.raises(ValueError, match="floating"):
        from_dense(jnp.ones((8, 8), jnp.int32), 0.5, 4)
    with pytest.raises(ValueError, match="2-D"):
        from_dense(jnp.ones((2, 8, 8)), 0.5, 4)
    with pytest.raises(ValueError, match="criterion"):
        from_dense(jnp.ones((8, 8)), 0.5, 4, criterion="linf")
    with pytest.raises(ValueError, match="selection"):
        from_dense(jnp.ones((8, 8)), 0.5, 4, selection="row")


@pytest.mark.parametrize("selection", ["global", "column"])
@pytest.mark.parametrize("keep", [1, 5, 12])
def test_top_blocks_break_ties_like_top_k_and_report_the_next_score(selection, keep):
    """The counting selection keeps exactly what lax.top_k keeps, ties to the lower flat index, on
    scores with many ties (small integers, zeros, inf), and returns the next-largest score."""
    from bsr_jax.storage.selection import top_blocks

    kb, mb = 3, 12
    scores = np.random.default_rng(keep).integers(0, 4, (kb, mb)).astype(np.float32)
    scores[1, 3] = np.inf
    capacity = keep * (kb if selection == "column" else 1)
    rows, cols, ptr, threshold = jax.jit(top_blocks, static_argnums=(1, 2, 3))(jnp.asarray(scores), capacity, selection, True)
    if selection == "global":
        top, flat = jax.lax.top_k(scores.reshape(-1), capacity + 1)
        want, next_score = np.sort(np.asarray(flat[:capacity])), top[capacity]
    else:
        top, idx = jax.lax.top_k(scores, min(keep + 1, mb))
        want = np.sort(np.asarray(idx[:, :keep]), axis=1) + mb * np.arange(kb)[:, None]
        want, next_score = want.reshape(-1), (top[:, keep] if keep < mb else np.zeros(kb, np.float32))
    np.testing.assert_array_equal(np.asarray(cols) * mb + np.asarray(rows), want)
    np.testing.assert_array_equal(threshold, next_score)
    np.testing.assert_array_equal(ptr, np.searchsorted(np.asarray(cols), np.arange(kb + 1)))


def test_window_gather_for_tpu_keeps_the_same_blocks():
    """from_dense lowered for a TPU gathers (bm, bk) windows of x itself (a 4-D view of x would be
    copied padded 8x there); elsewhere the 4-D view's advanced indices: the same blocks, bit for bit."""
    from bsr_jax.storage.format import _gather_from_view, _gather_windows

    xp = jax.random.normal(jax.random.key(0), (48, 40))
    rows, cols = jnp.array([0, 2, 1, 1, 2], jnp.int16), jnp.array([0, 0, 3, 4, 4])
    chex.assert_trees_all_equal(_gather_windows(xp, rows, cols, block=(16, 8)), _gather_from_view(xp, rows, cols, block=(16, 8)))


def test_from_dense_inlines_under_a_trace_and_is_one_program_eagerly():
    """Traced (a layer's forward), its ops are the caller's, no nested jit: XLA:TPU kept top-k's
    8 x 128 blocks at a higher peak through the nested call (test_compiled, -m slow)."""
    x = jnp.ones((64, 256), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x: from_dense(x, 0.5, (8, 128)).values)(x)
    nested = [eqn.params.get("name") for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name in ("jit", "pjit")]
    assert "quantize_blocks" in nested and not any("from_dense" in name for name in nested), nested
    eager = from_dense(x, 0.5, (8, 128))
    chex.assert_trees_all_equal(eager.to_dense(), jax.jit(lambda x: from_dense(x, 0.5, (8, 128)).to_dense())(x))

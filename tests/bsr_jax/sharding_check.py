"""Sharded-jit checks on 4 forced host devices; run by test_sharding.py in a fresh interpreter.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/bsr_jax/sharding_check.py

For data parallel (Explicit and Auto axes), (data 2, model 2) meshes with the kernel split over
"model" (tensor parallel; Explicit, and Auto under ``jax.set_mesh``) and an FSDP-split kernel: y
and dx equal the dense ones, dW equals the sum over row shards of the independent float64
reference's per-shard masked product (``tests/reference.py``), dW keeps the kernel's sharding, and
the compiled step has no all-gather (FSDP: only the kernel's). Also ``bsr_scale_shift``,
``compress_rows`` shared blocks and ``compress_model``'s shared q/k/v blocks, an op (top-k and int4) inside an
existing ``shard_map``, the Auto-axes errors without ``batch_axes`` / ``jax.set_mesh``, and
``compressed_conv`` (dW against the single-device op per batch shard).
"""

import contextlib
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS)]  # the repository's bsr_jax before tests/bsr_jax
sys.path.append(TESTS)  # tests/reference.py

import chex  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bsr_jax  # noqa: E402
import reference  # noqa: E402
from bsr_jax.core import sharding  # noqa: E402
from bsr_jax.ops.linear import linear_dims, pruned_dot_general  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)
PRUNING = bsr_jax.Pruning(0.7, block=4)
B, T, K, N = 8, 4, 16, 12  # 4 row shards of 2 x 4 = 8 rows: 2 block-rows each


BIAS = np.linspace(-1, 1, N).astype(np.float32)


def inputs():
    rng = np.random.default_rng(0)
    # Heavy-tailed blocks so the per-shard ranking is not decided by rounding.
    x = (rng.standard_t(2, size=(B, T, K)) * rng.uniform(0.1, 3, size=(B, 1, K))).astype(np.float32)
    return x, rng.normal(size=(K, N)).astype(np.float32), rng.normal(size=(B, T, N)).astype(np.float32)


def reference_grads(x, w, dy, shards: int):
    """dW as the sum over row shards of kept_input(shard).T @ dy(shard), in float64; y with BIAS
    and the bias gradient (exact)."""
    xs, dys = np.split(x.reshape(B * T, K), shards), np.split(dy.reshape(B * T, N), shards)
    dw = sum(reference.kept_input(xs_, PRUNING.sparsity, PRUNING.block).T @ dy_ for xs_, dy_ in zip(xs, dys))
    return x @ w + BIAS, dy @ w.T.astype(np.float64), dw, dy.astype(np.float64).sum((0, 1))


def grads(x, w, dy):
    def f(x, w, b):
        return bsr_jax.bsr_linear(x, w, b, pruning=PRUNING)

    def run(x, w, b, dy):
        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))

    return jax.jit(run), run


def check_linear(mesh, x_spec, w_spec, shards, declare=False, dy_spec=None):
    x, w, dy = inputs()
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    b_spec = P(*tuple(w_spec)[1:2])  # the kernel's output split
    args = (place(x, x_spec), place(w, w_spec), place(BIAS, b_spec), place(dy, x_spec if dy_spec is None else dy_spec))
    step, _ = grads(x, w, dy)
    with sharding.batch_axes("data") if declare else contextlib.nullcontext():
        y, dx, dw, db = step(*args)
        hlo = step.lower(*args).compile().as_text()
    chex.assert_trees_all_close(tuple(np.asarray(a) for a in (y, dx, dw, db)), reference_grads(x, w, dy, shards), **TOL)
    # Under Auto axes XLA may re-place the result; Explicit types keep it as the parameter's.
    if mesh.axis_types[0] == AxisType.Explicit:
        assert dw.sharding.spec == w_spec or (w_spec == P() and dw.sharding.is_fully_replicated), (dw.sharding, w_spec)
    return hlo


def place_on(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def gathered_shapes(hlo: str) -> list[str]:
    return [line.split("=")[1].split("all-gather")[0].strip() for line in hlo.splitlines() if "all-gather(" in line or "all-gather-start(" in line]


def check_conv(data4, auto4, grid, auto_grid):
    """compressed_conv: y and dx exact, dW the sum over batch shards of the single-device op on each
    shard, nothing gathered; data parallel (Explicit, Auto) and a kernel split over its output
    features on (data, model) meshes (Explicit, Auto)."""
    rng = np.random.default_rng(1)
    x = rng.standard_t(2, size=(8, 6, 6, 4)).astype(np.float32)
    w = rng.normal(size=(3, 3, 4, 6)).astype(np.float32)
    dy = rng.normal(size=(8, 3, 3, 6)).astype(np.float32)
    for compression in (PRUNING, bsr_jax.Pooling(2)):
        conv = lambda x, w: bsr_jax.compressed_conv(x, w, compression=compression, strides=2, padding="SAME")
        run = jax.jit(lambda x, w, d: (lambda y, vjp: (y, *vjp(d)))(*jax.vjp(conv, x, w)))
        exact = jax.vjp(lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), x, w)
        y_exact, dx_exact = exact[0], exact[1](dy)[0]
        for mesh, w_spec, shards in ((data4, P(), 4), (auto4, P(), 4), (grid, P(None, None, None, "model"), 2), (auto_grid, P(None, None, None, "model"), 2)):
            dw_shards = sum(run(xs_, w, dys_)[2] for xs_, dys_ in zip(np.split(x, shards), np.split(dy, shards)))
            place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
            dy_spec = P("data", None, None, "model") if "model" in mesh.axis_names else P("data")
            args = (place(x, P("data")), place(w, w_spec), place(dy, dy_spec))
            auto_2d = "model" in mesh.axis_names and mesh.axis_types[0] == AxisType.Auto
            with _auto_2d(mesh) if auto_2d else contextlib.nullcontext():
                compiled = run.lower(*args).compile()
                y, dx, dw = compiled(*args)
                hlo = compiled.as_text()
            chex.assert_trees_all_close((np.asarray(y), np.asarray(dx), np.asarray(dw)), (y_exact, dx_exact, dw_shards), **TOL)
            assert not gathered_shapes(hlo), (compression, mesh, gathered_shapes(hlo))


@contextlib.contextmanager
def _auto_2d(mesh):
    # Several Auto axes: the batch's must be declared, and the mesh set (see bsr_jax.core.sharding).
    with sharding.batch_axes("data"), jax.set_mesh(mesh):
        yield


def main() -> int:
    assert len(jax.devices()) == 4, jax.devices()
    data4 = jax.make_mesh((4,), ("data",))
    auto4 = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    grid = jax.make_mesh((2, 2), ("data", "model"))
    auto_grid = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    # 1. Data parallel, Explicit and Auto: per-shard top-k, dW summed, nothing gathered.
    for mesh in (data4, auto4):
        hlo = check_linear(mesh, P("data"), P(), shards=4)
        assert not gathered_shapes(hlo) and "all-reduce" in hlo, gathered_shapes(hlo)

    # 2. (data, model): kernel split along its outputs (tensor parallel), dW stays split; rows over data.
    hlo = check_linear(grid, P("data"), P(None, "model"), shards=2, dy_spec=P("data", None, "model"))
    assert not gathered_shapes(hlo), gathered_shapes(hlo)
    # Auto axes: the batch axis must be declared and the mesh set; "model" stays Auto inside the
    # op, so the kernel and dy stay split over it (the dW kernel runs per column shard).
    x, w, dy = inputs()
    for context, message in ((contextlib.nullcontext(), "batch_axes"), (sharding.batch_axes("data"), "set_mesh")):
        try:
            with context:
                grads(x, w, dy)[0](jax.device_put(x, NamedSharding(auto_grid, P("data"))), jax.device_put(w, NamedSharding(auto_grid, P())), BIAS, dy)
            raise AssertionError(f"several Auto axes without {message} must raise")
        except ValueError as e:
            assert message in str(e), e
    with _auto_2d(auto_grid):
        hlo = check_linear(auto_grid, P("data"), P(None, "model"), shards=2, declare=True, dy_spec=P("data", None, "model"))
        assert not gathered_shapes(hlo), gathered_shapes(hlo)
        # Row-parallel (x's features and the kernel's inputs split over "model"): the ranking stays
        # over each row shard's whole K, so only the (Kb, Mb) = (4, 4) block scores are gathered.
        hlo = check_linear(auto_grid, P("data", None, "model"), P("model", None), shards=2, declare=True, dy_spec=P("data"))
        assert all(s.startswith("f32[4,4]") for s in gathered_shapes(hlo)), gathered_shapes(hlo)

    # 3. FSDP: kernel split over the batch axis; only the kernel is gathered, dW comes back split.
    hlo = check_linear(grid, P("data"), P("data", "model"), shards=2, dy_spec=P("data", None, "model"))
    assert all(s.startswith("f32[8,") or s.startswith("f32[16,") for s in gathered_shapes(hlo)), gathered_shapes(hlo)

    # 4. Scale/shift: dscale is the sum over row shards of the per-shard masked column sums.
    x, _, dy = inputs()
    scale = np.linspace(0.5, 1.5, K).astype(np.float32)
    place = lambda a, spec: jax.device_put(a, NamedSharding(data4, spec))
    f = lambda x, s: bsr_jax.bsr_scale_shift(x, s, pruning=PRUNING)
    dy_k = dy[..., :1].repeat(K, -1)
    run = jax.jit(lambda x, s, d: jax.vjp(f, x, s)[1](d))
    dx, ds = run(place(x, P("data")), place(scale, P()), place(dy_k, P("data")))
    kept = [reference.kept_input(a, PRUNING.sparsity, PRUNING.block) for a in np.split(x.reshape(B * T, K), 4)]
    expected = sum((k * d).sum(0) for k, d in zip(kept, np.split(dy_k.reshape(B * T, K), 4)))
    chex.assert_trees_all_close((np.asarray(dx), np.asarray(ds)), (dy_k * scale, expected), **TOL)

    # 5. Shared blocks made per shard by compress_rows feed pruned_dot_general; global ones are refused.
    x, w, dy = inputs()
    xs, ws = place(x, P("data")), place(w, P())

    def shared(x, w):
        blocks = sharding.compress_rows(lambda a, k: PRUNING.compress(a, k), x.reshape(-1, K))
        return pruned_dot_general(x, w, linear_dims(3), pruning=PRUNING, blocks=blocks)

    out = jax.jit(lambda x, w, d: jax.vjp(shared, x, w)[1](d))(xs, ws, place(dy, P("data")))
    chex.assert_trees_all_close(np.asarray(out[1]), reference_grads(x, w, dy, 4)[2], **TOL)
    try:
        # (On Auto axes: on Explicit ones the global ranking does not even trace.)
        auto = lambda a: jax.device_put(a, NamedSharding(auto4, P("data")))
        jax.jit(lambda x, w: pruned_dot_general(x, w, linear_dims(3), pruning=PRUNING, blocks=PRUNING.compress(x)))(auto(x), w)
        raise AssertionError("globally compressed blocks must be refused under a mesh")
    except ValueError as e:
        assert "compress_rows" in str(e) or "row_stacked" in str(e), e

    # 5b. compress_model: q, k and v reading one x share blocks made per shard (compress_rows).
    class QKV(nn.Module):
        @nn.compact
        def __call__(self, x):
            return tuple(nn.Dense(N, bias_init=lambda *_: jnp.asarray(BIAS), name=name)(x) for name in "qkv")

    model = bsr_jax.compress_model(QKV(), [bsr_jax.Rule("*", PRUNING)], lean=False)
    params = model.init(jax.random.key(0), x)
    dys = tuple(np.roll(dy, i, axis=0) for i in range(3))
    run = jax.jit(lambda p, x, d: (lambda y, vjp: (y, *vjp(d)))(*jax.vjp(model.apply, p, x)))
    args = (jax.tree.map(lambda a: place(a, P()), params), xs, tuple(place(d, P("data")) for d in dys))
    ys, dparams, dx = run(*args)
    kernels = [np.asarray(params["params"][name]["kernel"]) for name in "qkv"]
    expected = [reference_grads(x, w_, d, 4) for w_, d in zip(kernels, dys)]
    chex.assert_trees_all_close(
        (tuple(np.asarray(y) for y in ys), np.asarray(dx), [tuple(np.asarray(a) for a in dparams["params"][name].values()) for name in "qkv"]),
        (tuple(e[0] for e in expected), sum(e[1] for e in expected), [(e[3], e[2]) for e in expected]), **TOL,
    )
    assert not gathered_shapes(run.lower(*args).compile().as_text())

    # 6. Inside an existing shard_map (train's loop) the op runs on the local rows unchanged.
    def local(x, w, dy):
        w = jax.lax.pcast(w, "data", to="varying")
        _, vjp = jax.vjp(lambda x, w: bsr_jax.bsr_linear(x, w, pruning=PRUNING), x, w)
        return jax.lax.psum(vjp(dy)[1], "data")

    mapped = jax.jit(jax.shard_map(local, mesh=data4, in_specs=(P("data"), P(), P("data")), out_specs=P()))
    dw = mapped(xs, ws, place(dy, P("data")))
    chex.assert_trees_all_close(np.asarray(dw), reference_grads(x, w, dy, 4)[2], **TOL)
    # 6b. Whole int4 matrices there too: the quantization (the CPU kernel, chosen by the lowering
    # platform inside shard_map as outside) gives each shard what the op gives it on one device.
    int4 = bsr_jax.Pruning(0.0, block=4, storage_dtype="int4")

    def local_int4(x, w, dy):
        w = jax.lax.pcast(w, "data", to="varying")
        _, vjp = jax.vjp(lambda x, w: bsr_jax.bsr_linear(x, w, pruning=int4), x, w)
        return jax.lax.psum(vjp(dy)[1], "data")

    mapped = jax.jit(jax.shard_map(local_int4, mesh=data4, in_specs=(P("data"), P(), P("data")), out_specs=P()))
    one_device = jax.jit(lambda x, w, dy: jax.vjp(lambda x, w: bsr_jax.bsr_linear(x, w, pruning=int4), x, w)[1](dy)[1])
    expected = sum(one_device(xs_, w, dy_) for xs_, dy_ in zip(np.split(x, 4), np.split(dy, 4)))
    chex.assert_trees_all_close(np.asarray(mapped(xs, ws, place(dy, P("data")))), np.asarray(expected), **TOL)
    # 7. Nothing to prune (sparsity 0) on Explicit axes with the contracted axis split on both sides
    # (a row-parallel layer): the exact product, where a plain dot_general (nn.Dense) would raise.
    x, w, dy = inputs()
    row_parallel = (place_on(grid, x, P("data", None, "model")), place_on(grid, w, P("model")), place_on(grid, BIAS, P()), place_on(grid, dy, P("data")))

    def dense_vjp(x, w, b, dy):
        y, vjp = jax.vjp(lambda x, w, b: bsr_jax.bsr_linear(x, w, b, pruning=bsr_jax.Pruning(0.0)), x, w, b)
        return (y, *vjp(dy))

    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    expected = (x64 @ w64 + BIAS, dy64 @ w64.T, x64.reshape(-1, K).T @ dy64.reshape(-1, N), dy64.sum((0, 1)))
    chex.assert_trees_all_close(tuple(np.asarray(a) for a in jax.jit(dense_vjp)(*row_parallel)), expected, **TOL)
    # The same layer pruned: the bias gradient, computed inside the op on each device, is not
    # counted once per shard of the contracted axis.
    y, dx, dw, db = jax.jit(grads(x, w, dy)[1])(*row_parallel)
    chex.assert_trees_all_close((np.asarray(y), np.asarray(dx), np.asarray(db)), (expected[0], expected[1], expected[3]), **TOL)
    check_conv(data4, auto4, grid, auto_grid)
    print("4 devices: sharding checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

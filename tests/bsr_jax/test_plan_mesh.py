"""bsr_jax.plan over a mesh: the arguments' shardings moved onto the deviceless target's devices,
the budget and peaks per device (bsr_jax.planning.placement)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import bsr_jax
from bsr_jax.measure.compiled import target_devices
from bsr_jax.planning import linen as planner_linen
from bsr_jax.planning import placement

pytestmark = pytest.mark.xdist_group("test_plan_mesh")


def _mesh(types=AxisType.Auto, shape=(4,), names=("data",)):
    return AbstractMesh(shape, names, axis_types=(types,) * len(shape))


def _struct(shape, mesh=None, spec=None, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()) if mesh is not None else None)


def test_the_arguments_mesh_is_rebuilt_on_the_targets_devices():
    mesh = _mesh(AxisType.Explicit, (2, 2), ("data", "model"))
    tree = {"w": _struct((8, 16), mesh, P(None, "model")), "x": _struct((4, 8), mesh, P("data")), "b": _struct((16,))}
    on = placement.target_mesh(tree, "h100")
    assert on.axis_names == ("data", "model") and on.axis_sizes == (2, 2) and on.axis_types == (AxisType.Explicit,) * 2
    assert set(on.devices.flat) == set(target_devices("h100")[:4])
    placed = placement.on_mesh(tree, on)
    assert {k: (a.sharding.mesh, a.sharding.spec) for k, a in placed.items()} == {"w": (on, P(None, "model")), "x": (on, P("data")), "b": (on, P())}
    assert placement.target_mesh({"b": _struct((16,))}, "h100") is None  # nothing placed by name: one device
    with pytest.raises(ValueError, match=r"\['head'\] of shape \(8, 9\) cannot be split as P\(None, 'model'\) over \{'data': 2, 'model': 2\}"):
        placement.on_mesh({"head": _struct((8, 9), mesh, P(None, "model"))}, on)


@pytest.mark.parametrize("tree,match", [
    ({"a": _struct((8,), _mesh()), "b": _struct((8,), _mesh(shape=(2,)))}, r"2 different meshes \(data=2; data=4\)"),
    ({"a": _struct((16,), _mesh(shape=(16,)))}, r"16 devices \({'data': 16}\); h100's deviceless topology has 8"),
])  # fmt: skip
def test_arguments_on_several_meshes_or_more_devices_than_the_target_has_are_named(tree, match):
    with pytest.raises(ValueError, match=match):
        placement.target_mesh(tree, "h100")


def test_adamw_moments_are_sharded_as_their_parameters_and_bytes_counted_per_device():
    mesh = placement.target_mesh({"w": _struct((8,), _mesh())}, "h100")
    params = {"w": _struct((64, 32), mesh, P(None, "data")), "b": _struct((32,), mesh)}
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = placement.optimizer_state_on_mesh(optimizer, params, jax.eval_shape(optimizer.init, params), mesh)
    adam = state[1][0]
    assert adam.mu["w"].sharding.spec == adam.nu["w"].sharding.spec == P(None, "data") and adam.mu["b"].sharding.spec == P()
    assert adam.count.sharding == NamedSharding(mesh, P())
    # w: a quarter of 64 x 32 f32 per device; b whole; the count's int32; mu and nu as their parameters.
    assert placement.bytes_per_device(params) == 64 * 8 * 4 + 32 * 4
    assert placement.bytes_per_device(state) == 2 * (64 * 8 * 4 + 32 * 4) + 4


@jax.custom_vjp
def _kernel(x):
    """A custom_vjp whose body runs in a jax.named_scope of its own, as Pallas splash attention's
    kernels do: the scope reads as a module path where its caller's is not in the name stack."""
    with jax.named_scope("splash_mha_fwd_no_residuals"):
        return x * 2


_kernel.defvjp(lambda x: (_kernel(x), None), lambda _, g: (2 * g,))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        h = nn.Dense(64)(nn.LayerNorm()(x))
        h = h.reshape(*h.shape[:2], 4, 16)  # (B, T, heads, head_dim)
        # jax.nn's attention differentiates by a custom_vjp, whose body traces with a fresh name stack
        o = _kernel(jax.nn.dot_product_attention(h, h, h, is_causal=True))
        return x + nn.Dense(64)(o.reshape(x.shape)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(name="layers")(nn.Dense(64)(x), None)
        return nn.Dense(10)(x.mean(1))


def test_a_scanned_block_with_custom_gradients_inside_is_one_block():
    x = jnp.zeros((2, 8, 16))
    v = jax.eval_shape(lambda: Scanned().init(jax.random.key(0), x))
    traced = jax.make_jaxpr(lambda v: Scanned().apply(v, x).sum())(v)
    assert planner_linen.find_blocks(traced.jaxpr, "Scanned") == (("layers",), True)


def _loss(module, variables, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(module.apply(variables, x), y).mean()


def _fsdp(mesh):
    """Each parameter split over "data" along its largest dimension that 4 divides (a stacked one
    not along the layers), as FSDP shards it."""

    def spec(path, a):
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        dims = [d for d, n in enumerate(a.shape) if n % 4 == 0 and not (stacked and d == 0)]
        return _struct(a.shape, mesh, P(*[None] * max(dims, key=lambda d: a.shape[d]), "data") if dims else P(), a.dtype)

    return spec


_ONE_DEVICE: dict = {}  # the one-device step's compile, shared by both parametrizations


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit])
def test_a_plan_over_a_mesh_is_per_device(types):
    """FSDP (Auto: parameters and AdamW's moments sharded) or data parallel (Explicit: replicated
    parameters, the batch's types carry its sharding) over 4 H100s: the dense step fits, so each is
    one compile, and its peak is one device's, a fraction of the one-device step's."""
    mesh = _mesh(types)
    x, y = _struct((64, 32, 16), mesh, P("data")), _struct((64,), mesh, P("data"), jnp.int32)
    variables = jax.eval_shape(lambda: Scanned().init(jax.random.key(0), jnp.zeros((1, 32, 16))))
    if types == AxisType.Auto:
        variables = jax.tree_util.tree_map_with_path(_fsdp(mesh), variables)
    same = dict(optimizer=optax.adamw(1e-3), budget="1GiB", target="h100", progress=False)
    sharded = bsr_jax.plan(Scanned(), _loss, x, y, variables=variables, **same)
    whole = bsr_jax.plan(Scanned(), _loss, _struct(x.shape), _struct(y.shape, dtype=jnp.int32),
                         variables=jax.tree.map(lambda a: _struct(a.shape, dtype=a.dtype), variables), cache=_ONE_DEVICE, **same)  # fmt: skip
    assert sharded.mesh == {"data": 4} and whole.mesh is None and "h100 x 4 (data=4; per device)" in str(sharded)
    assert sharded.peak < 0.5 * whole.peak

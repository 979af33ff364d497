"""compress_model names every linear product's input and output (``"<layer path>:input"``,
``":output"``) on linen, NNX and scanned models, changing no value; ``name_policy`` builds
``jax.checkpoint`` policies from per-name choices; the planner's MaxText-style named options."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core.primitives import name_p

import bsr_jax
from bsr_jax import Rule
from bsr_jax.core.names import RESIDUAL_NAME
from bsr_jax.planning.options import EXACT, OPTIONS

WIDTH = 16


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(WIDTH, name=n)(x) for n in ("q", "k", "v"))
        p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k))
        return nn.Dense(WIDTH, name="out")(jnp.einsum("bts,bsd->btd", p, v))


class Projection(nn.Module):
    """A hand-written layer: its ``x @ w`` is found by compress_model's product interception."""

    features: int

    @nn.compact
    def __call__(self, x):
        return x @ self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], self.features))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        x = x + Attention(name="attn")(nn.LayerNorm()(x))
        h = nn.gelu(Projection(4 * WIDTH, name="fc1")(nn.LayerNorm()(x)))
        return x + nn.Dense(WIDTH, name="fc2")(h), None


class Net(nn.Module):
    policy: object = None  # a jax.checkpoint policy for every block (nn.remat); None: no remat
    scanned: bool = False

    @nn.compact
    def __call__(self, x):
        block = Block if self.policy is None else nn.remat(Block, policy=self.policy)
        if self.scanned:
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)(name="layers")(x, None)
        else:
            for i in range(2):
                x, _ = block(name=f"block_{i}")(x)
        return nn.Dense(4, name="head")(x)


X = jax.random.normal(jax.random.key(1), (2, 8, WIDTH))
LAYERS = ("attn/q", "attn/k", "attn/v", "attn/out", "fc1", "fc2")


def _names(model, variables):
    return bsr_jax.tensor_names(lambda v, x: model.apply(v, x), variables, X)


def _loss_and_grads(model, variables):
    return jax.jit(jax.value_and_grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))(variables, X)


@functools.cache
def _plain():
    """The plain model's variables, and its loss and gradients: what every treatment is held to."""
    variables = Net().init(jax.random.key(0), X)
    return variables, _loss_and_grads(Net(), variables)


def test_linen_layers_are_named_by_path_and_role_without_changing_a_bit():
    model = Net()
    variables, plain = _plain()
    named = bsr_jax.compress_model(model, [Rule("*", None)], lean=False)  # no compression: names only
    expected = [f"block_{i}/{layer}:{role}" for i in range(2) for layer in LAYERS for role in ("input", "output")]
    assert _names(named, variables) == (*expected, "head:input", "head:output")
    assert _names(model, variables) == ()
    tagged = _loss_and_grads(named, variables)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(tagged), strict=True):
        np.testing.assert_array_equal(a, b)
    # Compressed layers and the layers no rule names are named too, beside bsr_jax's own residuals.
    compressed = bsr_jax.compress_model(model, [Rule("block_0/fc2", bsr_jax.Pruning(0.0, storage_dtype="int8"))])
    names = _names(compressed, variables)
    assert {"block_0/fc2:input", "block_0/fc2:output", "block_1/attn/q:output", RESIDUAL_NAME} <= set(names)


def test_scanned_layers_share_one_name_per_tensor():
    model = Net(policy=jax.checkpoint_policies.nothing_saveable, scanned=True)
    variables = model.init(jax.random.key(0), X)
    named = bsr_jax.compress_model(model, [Rule("*", None)], lean=False)
    # Not fc1's hand-written x @ w: inside nn.scan / nn.remat a layer's parameters enter as new
    # arrays, which the product interception cannot tell from activations (docs/planner.md).
    layers = [layer for layer in LAYERS if layer != "fc1"]
    assert _names(named, variables) == (*(f"layers/{layer}:{role}" for layer in layers for role in ("input", "output")), "head:input", "head:output")


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_nnx_layers_are_named_once_however_often_routed():
    model = bsr_jax.compress_model(NnxNet(nnx.Rngs(0)), [Rule("blocks/0/*", bsr_jax.Pruning(0.0, storage_dtype="int8")), Rule("*", None)], lean=False)
    model = bsr_jax.compress_model(model, [Rule("*", None)], lean=False)  # routed again: still one name per tensor
    graphdef, state = nnx.split(model)
    names = bsr_jax.tensor_names(lambda s, x: nnx.merge(graphdef, s)(x), state, X)
    layers = ("blocks/0/up", "blocks/0/down", "blocks/1/up", "blocks/1/down", "head")
    assert names == tuple(f"{layer}:{role}" for layer in layers for role in ("input", "output"))


@pytest.mark.slow  # 12 s of compiles; name_policy's choice per name and the named planner options hold by default below
def test_policies_keeping_some_outputs_are_exact_and_recomputing_all_peaks_below_keeping_all():
    variables, expected = _plain()
    rules = [Rule("*", None)]
    names = _names(bsr_jax.compress_model(Net(), rules, lean=False), variables)
    # The planner's named options, as plan applies them (remat by path, the model unedited).
    treated = bsr_jax.planner.assemble(Net(), ("block_0", "block_1"), ("remat-save-qkv", "remat-save-dots-except-mlp"))
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(_loss_and_grads(treated, variables)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    def peak(policy):
        model = bsr_jax.compress_model(Net(policy=policy), rules, lean=False)
        step = jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2))
        shape = jax.ShapeDtypeStruct((256, 128, WIDTH), jnp.float32)
        return bsr_jax.compiled_memory(step, jax.eval_shape(lambda: variables), shape, target="h100").peak

    recompute_all, keep_all = peak(bsr_jax.name_policy({}, names=names)), peak(bsr_jax.name_policy({"*": "keep"}, names=names))
    assert recompute_all < keep_all


def _choice(policy, name: str | None) -> str:
    """What ``policy`` does with the value named ``name`` (``None``: an unnamed ``add``'s output)."""
    out = policy(name_p, name=name) if name is not None else policy(jax.lax.add_p)
    if type(out).__name__ == "Offloadable":
        assert out.dst == "pinned_host"
        return "offload"
    return {"SaveableType": "keep", "RecomputeType": "recompute", "bool": "keep" if out else "recompute"}[type(out).__name__]


def test_name_policy_choices_per_name_first_glob_first():
    policy = bsr_jax.name_policy({"*/attn/*:output": "keep", "*:input": "offload", "*/fc1:*": "keep"}, default="recompute")
    assert _choice(policy, "block_0/attn/q:output") == "keep"
    assert _choice(policy, "block_0/fc1:input") == "offload"  # the earlier glob wins
    assert _choice(policy, "block_0/fc1:output") == "keep"
    assert _choice(policy, "block_0/fc2:output") == "recompute"
    assert _choice(policy, None) == "recompute"
    assert _choice(bsr_jax.name_policy({}, default="keep"), None) == "recompute"  # unnamed: recomputed whatever the default


@pytest.mark.parametrize(("choices", "default", "names", "message"), [
    ({"*:output": "save"}, "recompute", None, r"choices\['\*:output'\] must be one of \('keep', 'recompute', 'offload'\), got 'save'"),
    ({}, "device", None, r"default must be one of \('keep', 'recompute', 'offload'\)"),
    ({"*/atn/*:output": "keep", "*:input": "keep"}, "recompute", ("block_0/attn/q:output", "block_0/attn/q:input"),
     r"choices \['\*/atn/\*:output'\] match none of the 2 names given in names"),
])  # fmt: skip
def test_name_policy_errors_name_the_argument(choices, default, names, message):
    with pytest.raises(ValueError, match=message):
        bsr_jax.name_policy(choices, default=default, names=names)


NAMES = ("block_0/attn/q:input", "block_0/attn/q:output", "block_0/attn/out:output", "block_0/seq:output", "h/3/c_attn:output",
         "layers/attention/query:output", "block_0/mlp/fc1:output", "MlpBlock_0/Dense_0:output")  # fmt: skip
QKV = {"block_0/attn/q:output", "h/3/c_attn:output", "layers/attention/query:output"}
MLP = {"block_0/mlp/fc1:output", "MlpBlock_0/Dense_0:output"}
OUTPUTS = {n for n in NAMES if n.endswith(":output")}


@pytest.mark.parametrize(("option", "kept"), [("remat-minimal", OUTPUTS), ("remat-save-qkv", QKV), ("remat-save-dots-except-mlp", OUTPUTS - MLP)])
def test_named_planner_options_keep_outputs_by_role_and_are_opt_in(option, kept):
    policy = OPTIONS[option].policy
    assert {n for n in NAMES if _choice(policy, n) == "keep"} == kept
    assert OPTIONS[option].exact and OPTIONS[option].remat and option not in EXACT


def test_offloaded_qkv_option_offloads_only_qkv():
    assert {n for n in NAMES if _choice(OPTIONS["remat-offload-qkv"].policy, n) == "offload"} == QKV

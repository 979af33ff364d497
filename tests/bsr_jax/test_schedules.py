import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import bsr_jax
from bsr_jax.rewrite.schedules import layer_sparsity, prunable_layer_paths, scale_rules, warmup_sparsity
from bsr_jax.rewrite.sensitivity import gradient_sensitivity


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = bsr_jax.Affine(name="affine")(x)
        for i in range(2):
            x = jnp.tanh(bsr_jax.Dense(32, block=8, name=f"fc{i}")(x))
        return bsr_jax.LayerScale(0.5, block=8, name="scale")(x)


def _setup():
    x = jax.random.normal(jax.random.key(0), (64, 32))
    params = Net().init(jax.random.key(1), x)
    loss = lambda p, x: jnp.sum(Net().apply(p, x) ** 2)
    return x, params, loss


def test_warmup_sparsity_stairs():
    values = [warmup_sparsity(s, target=0.8, warmup_steps=100) for s in range(0, 130, 10)]
    assert values == [0.0, 0.0, 0.0, 0.2, 0.2, 0.4, 0.4, 0.4, 0.6, 0.6, 0.8, 0.8, 0.8]
    assert warmup_sparsity(5, target=0.7, warmup_steps=0) == 0.7
    with pytest.raises(ValueError, match="sparsity"):
        warmup_sparsity(0, target=1.2, warmup_steps=10)
    with pytest.raises(ValueError, match="levels"):
        warmup_sparsity(0, target=0.5, warmup_steps=10, levels=0)


def test_scale_rules():
    assert scale_rules((("*/fc1", 0.8), ("*", 0.5)), 0.5) == (("*/fc1", 0.4), ("*", 0.25))


def test_layer_paths_in_call_order():
    x, params, _ = _setup()
    assert prunable_layer_paths(Net().apply, params, x) == ["affine", "fc0", "fc1", "scale"]


def test_rules_first_match_wins_and_unmatched_keep_their_setting():
    x, params, loss = _setup()
    grad = lambda rules: jax.grad(lambda p: _with(rules, loss, p, x))(params)["params"]
    dense = grad(())
    only_fc1 = grad((("fc1", 0.75), ("fc*", 0.0)))
    chex.assert_trees_all_equal(only_fc1["fc0"], dense["fc0"])
    chex.assert_trees_all_equal(only_fc1["affine"], dense["affine"])
    assert not jnp.allclose(only_fc1["fc1"]["kernel"], dense["fc1"]["kernel"])
    chex.assert_trees_all_close(only_fc1["fc1"]["bias"], dense["fc1"]["bias"], atol=1e-5)
    with pytest.raises(ValueError, match="sparsity"):
        _with((("*", 1.0),), loss, params, x)


def _with(rules, loss, params, x):
    with layer_sparsity(rules):
        return loss(params, x)


@pytest.mark.parametrize(
    "rules, message",
    [
        ((("*", 1.2),), r"layer_sparsity rule \('\*', 1.2\): the sparsity must be a Python float in \[0, 1\), got 1.2"),
        ((("fc1", 0.5), ("*", -0.1)), r"rule \('\*', -0.1\): the sparsity must be a Python float in \[0, 1\)"),
        ((("*", 1.0),), r"in \[0, 1\), got 1.0"),
        ((("*", "0.5"),), r"in \[0, 1\), got '0.5'"),
        (("*", 0.5), r"rule '\*' must be a \(pattern, sparsity\) pair"),
        ("*=0.5", r"rules must be a sequence of \(pattern, sparsity\) pairs"),
    ],
)
def test_layer_sparsity_checks_its_rules_when_made_not_when_entered(rules, message):
    with pytest.raises(ValueError, match=message):
        layer_sparsity(rules)  # no `with`: the mistake is reported where the rules are written


def test_gradient_sensitivity_grows_with_sparsity_and_matches_single_layer_pruning():
    x, params, loss = _setup()
    paths = prunable_layer_paths(Net().apply, params, x)
    report = gradient_sensitivity(loss, params, x, paths=paths, sparsities=[0.25, 0.75])
    for path in paths:
        assert 0.0 < report[path][0.25] < report[path][0.75]
    alone = jax.grad(lambda p: _with((("fc0", 0.75), ("*", 0.0)), loss, p, x))(params)["params"]["fc0"]
    dense = jax.grad(loss)(params, x)["params"]["fc0"]
    err = jnp.linalg.norm(alone["kernel"] - dense["kernel"]) / jnp.linalg.norm(dense["kernel"])
    assert report["fc0"][0.75] == pytest.approx(float(err), rel=1e-3)

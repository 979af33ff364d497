"""bsr_jax.rewrite.lean_relu: ReLU's 1-bit mask by module path, as compress_model's lean rules by
path (the planner's blocks) give it to blocks whose layers a rule compresses."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import third_party_models as tpm

import bsr_jax
from bsr_jax import Pruning, Rule
from bsr_jax.rewrite.lean_relu import lean_relu

INT4 = Pruning(0.0, block=16, storage_dtype="int4")
C = tpm.TINY
BLOCKS = [f"encoderdecoderblock_{i}" for i in range(C.layers)]  # lm1b's ReLU MLP blocks


MASK = (C.batch * C.length // 8, C.mlp)  # ReLU's packed mask: 8 tokens a byte (int4 codes are uint8 too)


def _kept(model, params, tokens):
    loss = lambda p: tpm.lm_loss(model.apply(p, tokens), tokens)  # noqa: E731
    kept = bsr_jax.residual_bytes(loss, params).residuals
    return loss, [r.shape for r in kept if r.dtype == "uint8"].count(MASK)


def test_a_compressed_block_keeps_relus_mask_and_a_dense_one_does_not():
    """Block 0 compressed, block 1 lean and exact, lean by path: one packed mask, in block 0 only; gradients those of the same rules with every neighbour lean (lean=True)."""
    base = tpm.lm(C)
    tokens = jax.random.randint(jax.random.key(0), (C.batch, C.length), 0, C.vocab)
    params = tpm.jitter(base.init(jax.random.key(1), tokens))
    rules = [Rule(f"{BLOCKS[0]}/*", INT4), Rule(f"{BLOCKS[1]}/*", None)]
    by_path = bsr_jax.compress_model(base, rules, lean=[("*", True)])
    loss, masks = _kept(by_path, params, tokens)
    assert masks == 1
    everywhere = bsr_jax.compress_model(base, rules)
    chex.assert_trees_all_close(jax.grad(loss)(params), jax.grad(_kept(everywhere, params, tokens)[0])(params), atol=1e-6, rtol=1e-6)
    # No layer compressed below a lean block: it keeps the first Dense's output, no mask.
    assert _kept(bsr_jax.compress_model(base, [Rule("*", None)], lean=[("*", True)]), params, tokens)[1] == 0


class _Block(nn.Module):
    act: object = nn.relu  # as flax's ResNet examples hold their activation

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(self.act(nn.Dense(16)(x)))


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Block(name="b1")(_Block(name="b0")(x))


def test_where_decides_which_modules_relus_keep_the_mask_also_as_attributes():
    x = jax.random.normal(jax.random.key(0), (8, 4))
    model = _Two()
    params = model.init(jax.random.key(1), x)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)))  # noqa: E731

    def masks(where):
        with lean_relu(where):
            kept = bsr_jax.residual_bytes(loss, params).residuals
            grads = jax.grad(loss)(params)
        chex.assert_trees_all_close(grads, jax.grad(loss)(params), atol=1e-6, rtol=1e-6)
        return [r.shape for r in kept if r.dtype == "uint8"]

    assert masks(lambda path: path == "b0") == [(1, 16)]
    assert masks(lambda path: True) == [(1, 16), (1, 16)]
    assert masks(lambda path: False) == []
    assert nn.relu is jax.nn.relu and _Block.act is jax.nn.relu  # restored

"""compress_model recomputes no linear matmul: the grad step's FLOPs stay within 10% of dense
(issue 13's widths at 2 layers, batch 8; XLA cost analysis of the compiled step, nothing runs; dW through the
reference backend, so a pruned dW counts as a dense one and only recomputation shows)."""

import dataclasses

import jax
import third_party_models as tpm

from bsr_jax import Pruning, Rule, compress_model


def _grad_flops(model, params, x, loss):
    step = jax.jit(jax.grad(lambda p, x: loss(model.apply(p, x))))
    return step.lower(params, x).compile().cost_analysis()["flops"]


def test_grad_step_flops_within_ten_percent_of_dense(monkeypatch):
    """The LM: lean attention (probabilities recomputed), LayerNorms, a ReLU MLP, shared q/k/v."""
    monkeypatch.setenv("BSR_JAX_BACKEND", "reference")
    c = dataclasses.replace(tpm.ISSUE, layers=2)
    model, x = tpm.lm(c), tpm.tokens(c)
    loss = lambda out: tpm.lm_loss(out, x)  # noqa: E731
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    dense = _grad_flops(model, params, x, loss)
    compressed = _grad_flops(compress_model(model, [Rule("*", Pruning(0.7, block=16))]), params, x, loss)
    assert dense < compressed <= 1.10 * dense  # compression adds a little work, recomputation none

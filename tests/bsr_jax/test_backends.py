"""The dW backend is chosen by the platform a function is lowered for, not by the host."""

import jax
import jax.numpy as jnp
import pytest

import bsr_jax
from bsr_jax.backends import dispatch as backends

CPU_TARGET = "bsr_jax_cpu_bsr_t_matmul"


def _grad_text(platform: str, monkeypatch, backend=None) -> str:
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
    loss = lambda w: jnp.sum(bsr_jax.bsr_linear(x, w, sparsity=0.5, block=16, backend=backend))  # noqa: E731
    return jax.jit(jax.grad(loss)).trace(w).lower(lowering_platforms=(platform,)).as_text()


def test_default_backend_follows_the_lowering_platform(monkeypatch):
    assert backends.resolve_backend(None) == backends.AUTO
    cpu, cuda, tpu = (_grad_text(p, monkeypatch) for p in ("cpu", "cuda", "tpu"))
    assert CPU_TARGET in cpu and "triton" not in cpu
    assert "xla.gpu.triton" in cuda and CPU_TARGET not in cuda
    assert CPU_TARGET not in tpu and "triton" not in tpu


def test_an_explicit_backend_is_kept_on_every_platform(monkeypatch):
    assert CPU_TARGET not in _grad_text("cpu", monkeypatch, backend="xla")
    assert CPU_TARGET in _grad_text("cuda", monkeypatch, backend="cpu")  # asked for: no silent swap


def test_a_layers_pruning_names_its_backend_and_an_argument_that_disagrees_is_an_error(monkeypatch):
    from bsr_jax.storage import pruning

    assert tuple(backends.BACKENDS) == pruning.BACKENDS  # the one list Pruning checks against
    monkeypatch.setenv(backends.ENV_VAR, "xla")  # the layer's choice wins over the environment's
    x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
    on_cpu = bsr_jax.Pruning(0.5, block=16, backend="cpu")
    loss = lambda w: jnp.sum(bsr_jax.bsr_linear(x, w, pruning=on_cpu))  # noqa: E731
    assert CPU_TARGET in jax.jit(jax.grad(loss)).trace(w).lower(lowering_platforms=("cuda",)).as_text()
    assert backends.resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match=r"backend='xla' and the layer's Pruning\(backend='cpu'\) disagree"):
        bsr_jax.bsr_linear(x, w, pruning=on_cpu, backend="xla")
    with pytest.raises(ValueError, match=r"backend must be one of \('reference', .*got 'cuda'"):
        bsr_jax.Pruning(0.5, backend="cuda")

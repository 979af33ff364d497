"""``compiled_memory(..., target="h100")``: GEMMs compiled as a real H100 compiles them (Triton
fusions) where XLA tiles them deviceless, by default; cuBLAS with ``triton_gemm=False``, or with a
warning where no tiling is found."""

import jax
import jax.numpy as jnp
import pytest

import bsr_jax
from bsr_jax.measure import compiled


def _grad_step():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    return jax.grad(loss), (jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16))


def test_triton_gemm_fusions_are_the_default_and_cublas_one_argument_away():
    step, args = _grad_step()
    lowered = compiled.lower_for(step, *args, target="h100")
    cublas = compiled.compile_for(lowered, target="h100", triton_gemm=False).as_text()
    triton = compiled.compile_for(lowered, target="h100").as_text()
    assert "__cublas" in cublas and "__triton" not in cublas
    assert "__triton" in triton and "__cublas" not in triton
    measured, old = bsr_jax.compiled_memory(lowered, target="h100"), bsr_jax.compiled_memory(lowered, target="h100", triton_gemm=False)
    assert measured.triton_gemm and measured.modelled_seconds > 0
    assert not old.triton_gemm and old.modelled_seconds > 0


def test_triton_gemm_is_for_the_h100_target_only():
    step, args = _grad_step()
    with pytest.raises(ValueError, match="triton_gemm=True is for target='h100'"):
        compiled.compile_for(step, *args, target="host", triton_gemm=True)


def test_a_program_triton_cannot_tile_deviceless_falls_back_to_cublas_with_a_warning():
    class Untiled:  # stands in for ViT-B/16's step, whose f32 attention-output dot XLA cannot tile deviceless
        def compile(self, options):
            if options["xla_gpu_enable_triton_gemm"]:
                raise RuntimeError("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.476 = f32[12608,768]")
            return "compiled"

    Untiled.__module__ = "jax.stages"
    lowered = Untiled()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jax.stages, "Lowered", Untiled)
        assert compiled.compile_for(lowered, target="h100", triton_gemm=False) == "compiled"
        with pytest.warns(UserWarning, match=r"no Triton tiling .* compiled with cuBLAS GEMMs instead"):
            assert compiled.compile_for(lowered, target="h100") == "compiled"
        with pytest.raises(RuntimeError, match=r"no Triton tiling .* compile it with triton_gemm=False"):
            compiled.compile_for(lowered, target="h100", triton_gemm=True)

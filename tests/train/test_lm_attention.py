"""train.lm's --attention and --kv-heads: flash attention (jax.nn.dot_product_attention) computes what
the hand-written softmax does, for multi-head and grouped-query attention, in the model and in real
CLI steps; kv heads must divide heads; the 8b preset's size; older runs' config.json still resumes."""

from __future__ import annotations

import dataclasses
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import lm, lm_attention, lm_config, run_dir
from train.lm_attention import flash_attention, grouped_causal_attention
from train.lm_model import LM, PRESETS, LMShape, num_params
from tests.train.test_lm_train import CORPUS, one_line_error

SHAPE = LMShape(dim=32, depth=1, heads=4, hidden=64, vocab_size=97, seq_len=16)  # head dim 8
TOKENS = jax.random.randint(jax.random.key(0), (2, 17), 0, 97)
# The cheapest CLI run: bytes, 2 x 32, 4 heads, T 16, 3 steps, f32 (flash on CPU is XLA's either way).
TINY_FLAGS = ["--data-dir", CORPUS, "--val-fraction", "0.2", "--tokenizer", "bytes", "--dim", "32", "--depth", "2", "--heads", "4",
              "--seq-len", "16", "--batch-size", "8", "--steps", "3", "--log-every", "1", "--eval-windows", "8", "--dtype", "float32"]  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BSR_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_attention_names_match_the_flag_list():
    assert lm_attention.ATTENTIONS == lm_config.ATTENTIONS


def _loss_and_grads(model: LM, params):
    def loss(p):
        logits = model.apply({"params": p}, TOKENS[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("kv_heads, scan", [(None, False), (2, False), (1, True)])  # MHA, GQA, MQA (scanned)
def test_flash_attention_computes_what_the_hand_written_one_does(kv_heads, scan):
    shape = dataclasses.replace(SHAPE, kv_heads=kv_heads)
    xla, flash = (LM(shape, scan=scan, dtype=jnp.float32, attention=a) for a in ("xla", "flash"))
    params = xla.init(jax.random.key(1), TOKENS[:, :-1])["params"]
    assert sum(x.size for x in jax.tree.leaves(params)) == num_params(shape)
    kv_dim = 8 * (kv_heads or 4)
    attn = params["layers" if scan else "layer_0"]["attn"]
    assert attn["k"]["kernel"].shape[-1] == attn["v"]["kernel"].shape[-1] == kv_dim and attn["q"]["kernel"].shape[-1] == 32
    chex.assert_trees_all_close(_loss_and_grads(flash, params), _loss_and_grads(xla, params), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the float32 equality holds the claim; bf16 repeats it at its rounding
@pytest.mark.filterwarnings("ignore:--attention flash")  # a host without cuDNN: the GPU branch would be XLA's
def test_flash_attention_in_bfloat16_follows_the_hand_written_one():
    """bf16, the dtype cuDNN's kernel takes: on a GPU cuDNN's flash attention, here XLA's; either
    way the loss within bf16 rounding of the hand-written attention's."""
    shape = dataclasses.replace(SHAPE, kv_heads=2)
    xla, flash = (LM(shape, attention=a) for a in ("xla", "flash"))
    params = xla.init(jax.random.key(1), TOKENS[:, :-1])["params"]
    np.testing.assert_allclose(_loss_and_grads(flash, params)[0], _loss_and_grads(xla, params)[0], rtol=1e-2)


def test_grouped_query_heads_share_their_group_key_value_head():
    """Query heads 0-1 read key/value head 0, heads 2-3 head 1 (jax.nn.dot_product_attention's grouping)."""
    q = jax.random.normal(jax.random.key(2), (2, 6, 4, 8))
    k, v = jax.random.normal(jax.random.key(3), (2, 2, 6, 2, 8))
    out = jax.jit(grouped_causal_attention)(q, k, v)
    for h in range(4):
        one = jax.jit(grouped_causal_attention)(q[:, :, h : h + 1], k[:, :, h // 2 : h // 2 + 1], v[:, :, h // 2 : h // 2 + 1])
        np.testing.assert_allclose(out[:, :, h], one[:, :, 0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(flash_attention)(q, k, v), out, rtol=1e-5, atol=1e-5)


def test_splash_attention_computes_what_the_hand_written_one_does():
    """Pallas splash attention (the TPU's ``--attention flash``), in Pallas's interpreter: grouped
    heads (4 query, 2 key/value), two 128-token blocks under the causal mask; output and gradients
    against the hand-written attention, f32."""
    q = jax.random.normal(jax.random.key(4), (1, 256, 4, 128))
    k, v = jax.random.normal(jax.random.key(5), (2, 1, 256, 2, 128))
    reference = grouped_causal_attention(q, k, v)
    chex.assert_trees_all_close(lm_attention.splash_attention(q, k, v, interpret=True), reference, rtol=1e-5, atol=1e-5)
    grads = [jax.grad(lambda *a: (fn(*a) * reference).sum(), argnums=(0, 1, 2))(q, k, v)
             for fn in (functools.partial(lm_attention.splash_attention, interpret=True), grouped_causal_attention)]  # fmt: skip
    chex.assert_trees_all_close(*grads, rtol=1e-4, atol=1e-4)


def test_flash_attention_lowers_to_splash_kernels_for_a_tpu_which_the_roofline_times():
    """Compiled deviceless for TPU v5p: splash's three kernels, whose products the roofline counts
    (XLA's cost model counts none: a Mosaic call without a cost estimate), the causal mask's share
    read from the kernels' block mask (3 of 4 blocks of 512 at T 1024)."""
    from bsr_jax.measure import roofline
    from bsr_jax.measure.compiled import compile_for

    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    step = jax.grad(lambda q, k, v: flash_attention(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    kernels = {k.name.split(".")[0]: k.flops for k in roofline.roofline(compile_for(step, q, kv, kv, target="tpu-v5p").as_text(), "tpu-v5p").kernels}
    product = 2 * 8 * 1024 * 1024 * 128 * 0.75  # one product over the scores the mask keeps
    assert kernels["splash_mha_fwd_residuals"] == 2 * product
    assert kernels["splash_mha_dq_no_residuals"] == 3 * product and kernels["splash_mha_dkv_no_residuals"] == 4 * product


def test_8b_preset_is_llama3_8b_shaped():
    shape = PRESETS["8b"]
    assert (shape.dim, shape.depth, shape.heads, shape.kv_heads, shape.hidden, shape.vocab_size, shape.seq_len) == (
        4096, 32, 32, 8, 14336, 128256, 8192)  # fmt: skip
    # Shapes only (scanned: one traced layer); 8.03e9 with the untied head, as Llama 3 8B's 8,030,261,248.
    params = jax.eval_shape(LM(shape, scan=True).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert sum(x.size for x in jax.tree.leaves(params)) == num_params(shape) == 8_030_261_248


def _losses(workdir) -> list[float]:
    return [r["loss"] for r in run_dir.read_records(str(workdir)) if r["kind"] == "train"]


@pytest.mark.slow  # 11 s of CLI runs; flash attention's equality holds by default in the function-level test above
def test_cli_flash_steps_give_the_hand_written_losses(cache):
    """A few real steps of ``python -m train.lm`` with grouped-query attention: the same losses
    under --attention flash as under --attention xla, to f32 rounding; config.json records both flags."""
    for attention in ("xla", "flash"):
        assert lm.main([*TINY_FLAGS, "--kv-heads", "2", "--attention", attention, "--workdir", str(cache / attention)]) == 0
    saved = json.load(open(cache / "flash" / "config.json"))["config"]
    assert (saved["attention"], saved["kv_heads"]) == ("flash", 2)
    assert len(_losses(cache / "flash")) == 3
    np.testing.assert_allclose(_losses(cache / "flash"), _losses(cache / "xla"), rtol=1e-5)


def test_kv_heads_must_divide_heads(cache, capsys):
    workdir = str(cache / "run")
    assert "--kv-heads 3 must divide --heads 4: one of [1, 2, 4]" in one_line_error(capsys, [*TINY_FLAGS, "--kv-heads", "3", "--workdir", workdir])
    assert "--kv-heads" in one_line_error(capsys, [*TINY_FLAGS, "--kv-heads", "0", "--workdir", workdir])
    assert "--attention" in one_line_error(capsys, [*TINY_FLAGS, "--attention", "splash", "--workdir", workdir])


@pytest.mark.slow  # 9 s of CLI runs; resuming across settings holds by default in test_loop and test_cli
def test_a_run_from_before_the_flags_resumes_with_their_defaults(cache):
    """config.json written without ``attention`` and ``kv_heads`` loads with the defaults (xla,
    multi-head attention) and resumes; the resumed run writes them."""
    workdir = cache / "old"
    assert lm.main([*TINY_FLAGS, "--stop-at", "2", "--workdir", str(workdir)]) == 0
    saved = json.load(open(workdir / "config.json"))
    for name in ("attention", "kv_heads"):
        del saved["config"][name]
    (workdir / "config.json").write_text(json.dumps(saved))
    assert lm_config.LMConfig.from_json(saved["config"]) == lm_config.LMConfig.from_json({**saved["config"], "attention": "xla"})
    assert lm.main(["--resume", "--stop-at", "3", "--workdir", str(workdir)]) == 0
    assert [r["step"] for r in run_dir.read_records(str(workdir)) if r["kind"] == "train"] == [1, 2, 3]
    resumed = json.load(open(workdir / "config.json"))["config"]
    assert (resumed["attention"], resumed["kv_heads"]) == ("xla", None)

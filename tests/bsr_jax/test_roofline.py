"""The modelled step time (bsr_jax.measure.roofline): its arithmetic on hand-written HLO, and on programs
compiled deviceless for H100 and TPU v5p, against counts derived by hand from their shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import bsr_jax
from bsr_jax.measure import roofline as rl
from bsr_jax.measure.compiled import compiled_memory

# Round numbers make every expected time a hand computation: 1 GB/s, 1 GFLOP/s, 1 s a launch.
TOY = rl.Hardware("toy", hbm_bytes_per_s=1e9, matmul_flops={"bf16": 2e9}, default_flops=1e9, launch_s=1.0, host_bytes_per_s=1e8,
                  link_bytes_per_s=1e8)  # fmt: skip

ELEMENTWISE = """HloModule m

%fused_add (p0: f32[1000], p1: f32[1000]) -> f32[1000] {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[1000]{0} parameter(1)
  ROOT %add.1 = f32[1000]{0} add(%p0, %p1), metadata={op_name="jit(f)/block0/add"}
}

ENTRY %main (a: f32[1000], b: f32[1000]) -> f32[1000] {
  %a = f32[1000]{0} parameter(0)
  %b = f32[1000]{0} parameter(1)
  ROOT %fusion = f32[1000]{0} fusion(%a, %b), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/block0/add"}
}
"""


def _matmul(dtype: str, m: int, k: int, n: int) -> str:
    return f"""HloModule m

ENTRY %main (a: {dtype}[{m},{k}], b: {dtype}[{k},{n}]) -> {dtype}[{m},{n}] {{
  %a = {dtype}[{m},{k}]{{1,0}} parameter(0)
  %b = {dtype}[{k},{n}]{{1,0}} parameter(1)
  ROOT %dot = {dtype}[{m},{n}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


def _loop(trip_annotation: bool) -> str:
    # The body runs one fusion over f32[250] (1000 bytes in, 1000 out); the count is XLA:GPU's
    # annotation, or (as XLA:TPU writes loops) only the condition's `i < 5`.
    config = ', backend_config={"known_trip_count":{"n":"5"}}' if trip_annotation else ""
    return f"""HloModule m

%fused_neg (p0: f32[250]) -> f32[250] {{
  %p0 = f32[250]{{0}} parameter(0)
  ROOT %neg = f32[250]{{0}} negate(%p0)
}}

%body (t: (s32[], f32[250])) -> (s32[], f32[250]) {{
  %t = (s32[], f32[250]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[250]{{0}} get-tuple-element(%t), index=1
  %f = f32[250]{{0}} fusion(%v), kind=kLoop, calls=%fused_neg
  ROOT %r = (s32[], f32[250]{{0}}) tuple(%i, %f)
}}

%cond (t.1: (s32[], f32[250])) -> pred[] {{
  %five = s32[] constant(5)
  %t.1 = (s32[], f32[250]{{0}}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  ROOT %lt = pred[] compare(%i.1, %five), direction=LT
}}

ENTRY %main (x: (s32[], f32[250])) -> (s32[], f32[250]) {{
  %x = (s32[], f32[250]{{0}}) parameter(0)
  ROOT %w = (s32[], f32[250]{{0}}) while(%x), condition=%cond, body=%body{config}
}}
"""


def test_an_elementwise_kernel_costs_its_bytes_and_one_launch():
    r = rl.roofline(ELEMENTWISE, TOY)
    assert r.bytes == 3 * 4000  # two operands read, one output written
    assert r.flops == 0
    assert r.seconds == pytest.approx(12000 / 1e9 + 1.0)
    (kernel,) = r.kernels
    assert (kernel.name, kernel.op, kernel.count) == ("fusion", "jit(f)/block0/add", 1)


def test_a_matmul_costs_the_larger_of_its_bytes_and_its_flops_at_its_dtypes_peak():
    m, k, n = 64, 128, 32
    flops = 2 * m * k * n
    f32 = rl.roofline(_matmul("f32", m, k, n), TOY)
    assert f32.flops == flops
    assert f32.bytes == 4 * (m * k + k * n + m * n)
    assert f32.seconds == pytest.approx(max(f32.bytes / 1e9, flops / 1e9) + 1.0)  # f32: the default peak
    bf16 = rl.roofline(_matmul("bf16", m, k, n), TOY)
    assert bf16.seconds == pytest.approx(max(bf16.bytes / 1e9, flops / 2e9) + 1.0)  # bf16's own peak


@pytest.mark.parametrize("annotated", [True, False])
def test_a_loop_body_counts_once_per_trip(annotated):
    r = rl.roofline(_loop(annotated), TOY)
    kernels = {k.name: k for k in r.kernels}
    assert kernels["f"].count == kernels["lt"].count == 5  # the body's fusion and the condition's test
    assert kernels["f"].bytes == 5 * 2000
    assert kernels["lt"].bytes == 5 * (4 + 4 + 1)  # two s32 in, a pred out
    assert r.seconds == pytest.approx(5 * (2000 / 1e9 + 1.0) + 5 * (9 / 1e9 + 1.0))


def _collectives(groups: str) -> str:
    # As XLA:GPU writes an FSDP step's collectives: a 4 MB f32[1000,1000] gathered from, and its
    # gradient scattered to, f32[250,1000] shards; a scalar all-reduced; all async (-start/-done).
    return f"""HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (w: f32[250,1000], g: f32[1000,1000], l: f32[]) -> (f32[1000,1000], f32[250,1000], f32[]) {{
  %w = f32[250,1000]{{1,0}} parameter(0)
  %g = f32[1000,1000]{{1,0}} parameter(1)
  %l = f32[] parameter(2)
  %ag = (f32[250,1000]{{1,0}}, f32[1000,1000]{{1,0}}) all-gather-start(%w), channel_id=1, replica_groups={groups}, dimensions={{0}}
  %agd = f32[1000,1000]{{1,0}} all-gather-done(%ag)
  %rs = ((f32[1000,1000]{{1,0}}), f32[250,1000]{{1,0}}) reduce-scatter-start(%g), channel_id=2, replica_groups={groups}, dimensions={{0}}, to_apply=%sum
  %rsd = f32[250,1000]{{1,0}} reduce-scatter-done(%rs)
  %ar = f32[] all-reduce-start(%l), channel_id=3, replica_groups={groups}, to_apply=%sum
  %ard = f32[] all-reduce-done(%ar)
  ROOT %t = (f32[1000,1000]{{1,0}}, f32[250,1000]{{1,0}}, f32[]) tuple(%agd, %rsd, %ard)
}}
"""


# The listed, iota and mesh forms (the last is what XLA writes for jax.jit's SPMD programs: read as
# one device per group, every collective of a jitted FSDP step cost no link time).
@pytest.mark.parametrize("groups", ["{{0,1,2,3}}", "[1,4]<=[4]", "mesh['axis_0'=4,'axis_1'=1] {'axis_0'}", "mesh['x'=2,'y'=2] {'x','y'}"])
def test_a_collective_costs_what_each_device_sends_over_the_link(groups):
    """Ring all-gather and reduce-scatter of a 4 MB array over 4 devices: each sends 3 MB, 0.03 s
    at the toy link's 100 MB/s, over the HBM bound of the bytes they touch (operand and output
    tuple, as every kernel's are counted: 6 MB, 0.006 s); the
    scalar all-reduce its 4 bytes x 2 x 3/4; each a launch; the -done halves nothing."""
    r = rl.roofline(_collectives(groups), TOY)
    times = {k.name: k.seconds for k in r.kernels}
    assert set(times) == {"ag", "rs", "ar"}
    assert times["ag"] == pytest.approx(3e6 / 1e8 + 1.0) and times["rs"] == pytest.approx(3e6 / 1e8 + 1.0)
    assert times["ar"] == pytest.approx(1.0 + max(8 / 1e9, 4 * 2 * 0.75 / 1e8))
    one_device = rl.roofline(_collectives("{{0}}"), TOY)
    assert {k.name: k.seconds for k in one_device.kernels}["ag"] == pytest.approx(6e6 / 1e9 + 1.0)  # no link: HBM alone


COMBINED = """HloModule m

ENTRY %main (a: f32[250,1000], b: f32[250,1000]) -> (f32[1000,1000], f32[1000,1000]) {
  %a = f32[250,1000]{1,0} parameter(0)
  %b = f32[250,1000]{1,0} parameter(1)
  %ag = ((f32[250,1000]{1,0}, f32[250,1000]{1,0}), (f32[1000,1000]{1,0}, f32[1000,1000]{1,0})) all-gather-start(%a, %b), channel_id=1, replica_groups=mesh['axis_0'=4] {'axis_0'}, dimensions={0}
  ROOT %agd = (f32[1000,1000]{1,0}, f32[1000,1000]{1,0}) all-gather-done(%ag)
}
"""


def test_a_combined_collective_sends_every_array_it_holds():
    """XLA's combiners gather several arrays in one instruction: two 4 MB arrays over 4 devices send
    6 MB from each (0.06 s on the toy link), not the larger one's 3 MB."""
    (kernel,) = rl.roofline(COMBINED, TOY).kernels
    assert kernel.seconds == pytest.approx(6e6 / 1e8 + 1.0)


def test_time_is_monotone_in_bytes_and_flops():
    small, large = rl.roofline(_matmul("f32", 64, 128, 32), TOY), rl.roofline(_matmul("f32", 64, 256, 32), TOY)
    assert large.flops > small.flops and large.bytes > small.bytes and large.seconds > small.seconds
    faster_memory = dataclasses.replace(TOY, hbm_bytes_per_s=2e9)
    assert rl.roofline(ELEMENTWISE, faster_memory).seconds < rl.roofline(ELEMENTWISE, TOY).seconds
    faster_math = dataclasses.replace(TOY, default_flops=2e9)
    assert rl.roofline(_matmul("f32", 64, 128, 32), faster_math).seconds < small.seconds


def test_a_fusion_xla_left_unnamed_takes_the_name_of_what_it_computes():
    """XLA builds some fusions without metadata (``fusion.926``, attention's softmax in the 12 x 768
    LM: 12 x 768 MiB live at the peak and 483 us each, owned by no module): they take the op name
    of the last named instruction of the computation they call, so the planner's cost model
    (``bsr_jax.planning.cost.shares``) can tell which block they belong to."""
    unnamed = ELEMENTWISE.replace('calls=%fused_add, metadata={op_name="jit(f)/block0/add"}', "calls=%fused_add")
    assert "metadata" not in unnamed.split("ENTRY")[1]
    (kernel,) = rl.roofline(unnamed, TOY).kernels
    assert kernel.name == "fusion" and kernel.op == "jit(f)/block0/add"


OFFLOADED = """HloModule m

ENTRY %main (a: f32[1000]) -> f32[1000] {
  %a = f32[1000]{0} parameter(0)
  %tanh = f32[1000]{0} tanh(%a), metadata={op_name="jit(f)/block3/tanh"}
  %copy-start = (f32[1000]{0:S(5)}, f32[1000]{0}, u32[]) copy-start(%tanh)
  %copy-done = f32[1000]{0:S(5)} copy-done(%copy-start)
  ROOT %copy = f32[1000]{0} copy(%copy-done)
}
"""


def test_a_host_copy_takes_the_name_of_what_it_moves():
    """Host offload's copies carry no op name of their own: they take their operand's, so the cost
    model (``bsr_jax.planning.cost.shares``) charges the host link's time to the block whose
    activation moves."""
    (out, back) = sorted(rl.roofline(OFFLOADED, TOY).transfers, key=lambda k: k.name)
    assert out.name == "copy" and back.name == "copy-start"
    assert out.op == back.op == "jit(f)/block3/tanh" and out.seconds == back.seconds == 4000 / TOY.host_bytes_per_s


def test_compiled_for_h100_a_matmul_counts_its_flops_and_an_elementwise_op_its_bytes():
    a, b = jax.ShapeDtypeStruct((512, 256), jnp.float32), jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    step = compiled_memory(lambda a, b: a @ b, a, b, target="h100", breakdown=True)
    assert step.flops == 2 * 512 * 256 * 1024
    assert step.modelled_seconds == step.roofline_seconds >= 2 * 512 * 256 * 1024 / rl.H100.matmul_flops["f32"]
    assert step.kernels and step.kernels[0].flops == step.flops
    elementwise = compiled_memory(lambda a: jnp.tanh(a) * 2, a, target="h100", breakdown=True)
    (kernel,) = elementwise.kernels
    assert kernel.bytes == 2 * 512 * 256 * 4
    assert elementwise.modelled_seconds == pytest.approx(kernel.bytes / rl.H100.hbm_bytes_per_s + rl.H100.launch_s)


def test_on_tpu_the_modelled_time_is_xlas_own_and_the_roofline_is_beside_it():
    a, b = jax.ShapeDtypeStruct((512, 256), jnp.float32), jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    step = compiled_memory(lambda a, b: a @ b, a, b, target="tpu-v5p")
    assert step.modelled_seconds == step.optimal_seconds > 0
    assert step.roofline_seconds >= 2 * 512 * 256 * 1024 / rl.TPU_V5P.default_flops
    host = compiled_memory(lambda a, b: a @ b, a, b)
    assert host.modelled_seconds is None and host.roofline_seconds is None


def test_on_tpu_a_loop_body_counts_once_per_trip_in_the_modelled_time():
    """XLA:TPU's cost model counts a while loop's body once: the same work scanned in 1, 2 and 4
    trips is timed 101, 50 and 39 us (measured, 1024 x 1024 weights). ``modelled_seconds`` scales
    it by the roofline's ratio of the trips counted to the body once: 101, 72 and 73 us. Approximate:
    the roofline puts half this program outside the loop (x's relayout), XLA almost none; a
    training step's loop body (a micro-batch, a scanned layer) is most of both."""
    w, x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32), jax.ShapeDtypeStruct((8192, 1024), jnp.float32)

    def scanned(trips):
        def fn(w, x):
            body = lambda total, xi: (total + jnp.tanh(xi @ w).sum(), None)  # noqa: E731
            return jax.lax.scan(body, 0.0, x.reshape(trips, -1, x.shape[-1]))[0]

        return compiled_memory(fn, w, x, target="tpu-v5p")

    one, two, four = (scanned(trips) for trips in (1, 2, 4))
    assert four.optimal_seconds < 0.5 * one.optimal_seconds  # XLA's own figure: the body once
    assert two.modelled_seconds > 0.65 * one.modelled_seconds and four.modelled_seconds > 0.65 * one.modelled_seconds


def test_the_pallas_weight_gradient_is_not_free_to_the_roofline():
    """XLA:GPU's Triton call carries no cost estimate: the roofline counts the kernel's FLOPs from
    its operand shapes, and its bytes at least those of its operands and result."""
    x, w = jax.ShapeDtypeStruct((1024, 512), jnp.float32), jax.ShapeDtypeStruct((512, 256), jnp.float32)

    def loss(x, w):
        return jnp.sum(bsr_jax.bsr_linear(x, w, sparsity=0.5, block=16, backend="pallas") ** 2)

    step = compiled_memory(jax.grad(loss, argnums=1), x, w, target="h100", breakdown=True)
    (kernel,) = [k for k in step.kernels if k.op.endswith("bsr_t_matmul/pallas_call")]
    kept = 1024 // 16 * 512 // 16 // 2  # blocks at sparsity 0.5
    assert kernel.flops == 2 * kept * 16 * 16 * 256
    moved = 4 * (kept * 16 * 16 + 1024 * 256 + 512 * 256)  # kept blocks, dy, dW
    assert kernel.bytes >= moved
    assert kernel.seconds >= moved / rl.H100.hbm_bytes_per_s
    assert step.modelled_seconds >= kernel.seconds


IN_PLACE = """HloModule m

%fused_dus (buf: f32[100,250], upd: f32[1,250], i: s32[]) -> f32[100,250] {
  %buf = f32[100,250]{1,0} parameter(0)
  %upd = f32[1,250]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[100,250]{1,0} dynamic-update-slice(%buf, %upd, %i, %zero)
}

ENTRY %main (b: f32[100,250], u: f32[1,250], j: s32[], s: f32[100,250]) -> (f32[100,250], f32[1,250]) {
  %b = f32[100,250]{1,0} parameter(0)
  %u = f32[1,250]{1,0} parameter(1)
  %j = s32[] parameter(2)
  %s = f32[100,250]{1,0} parameter(3)
  %zero.1 = s32[] constant(0)
  %f = f32[100,250]{1,0} fusion(%b, %u, %j), kind=kLoop, calls=%fused_dus
  %ds = f32[1,250]{1,0} dynamic-slice(%s, %j, %zero.1), dynamic_slice_sizes={1,250}
  ROOT %t = (f32[100,250]{1,0}, f32[1,250]{1,0}) tuple(%f, %ds)
}
"""


# The same write as XLA:GPU often fuses it: the stack and the update seen through bitcasts (a
# layout change that moves nothing), as a scanned layer's gradient is written into its stack.
IN_PLACE_VIEWS = IN_PLACE.replace(
    "  ROOT %dus = f32[100,250]{1,0} dynamic-update-slice(%buf, %upd, %i, %zero)",
    "  %view = f32[250,100]{0,1} bitcast(%buf)\n  %upd.1 = f32[250,1]{0,1} bitcast(%upd)\n"
    "  %dus.1 = f32[250,100]{0,1} dynamic-update-slice(%view, %upd.1, %zero, %i)\n  ROOT %dus = f32[100,250]{1,0} bitcast(%dus.1)",
)


@pytest.mark.parametrize("hlo", [IN_PLACE, IN_PLACE_VIEWS], ids=["direct", "through-bitcasts"])
def test_scanned_layers_move_their_slices_not_their_stacks(hlo):
    """A scan writes one layer's slice of a stacked buffer in place and reads one slice of another:
    each kernel moves the slice (1000 bytes) and its indices, not the (100, 250) stack."""
    assert hlo.count("bitcast") in (0, 3)
    kernels = {k.name: k for k in rl.roofline(hlo, TOY).kernels}
    assert kernels["f"].bytes == 1000 + 4 + 1000  # the update read, the index, the update written
    assert kernels["ds"].bytes == 1000 + 2 * 4 + 1000  # the slice read, two indices, the slice written


def test_tpu_batched_dots_written_as_dilated_convolutions_count_xlas_flops():
    """XLA:TPU writes attention's batched einsum as a convolution whose lhs is dilated as wide as
    its window: one tap of each window reads data. The roofline's count equals XLA's own."""
    p, v = jax.ShapeDtypeStruct((4, 2, 40, 40), jnp.float32), jax.ShapeDtypeStruct((4, 40, 2, 16), jnp.float32)
    step = compiled_memory(lambda p, v: jnp.einsum("bhqk,bkhd->bqhd", p, v), p, v, target="tpu-v5p")
    compiled = bsr_jax.measure.compiled.compile_for(lambda p, v: jnp.einsum("bhqk,bkhd->bqhd", p, v), p, v, target="tpu-v5p")
    assert "lhs_dilate" in compiled.as_text()
    assert rl.roofline(compiled.as_text(), "tpu-v5p").flops == step.flops == 2 * 4 * 2 * 40 * 40 * 16


def _flash(target: str, mask: str) -> str:
    # cuDNN's flash attention as XLA:GPU prints it (jax.nn.dot_product_attention, implementation="cudnn",
    # compiled deviceless for an H100 with cuDNN 9.28; its backend config cut to what the count reads).
    config = ('{"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", '
              f'"dimensions": ["1", "8", "1024", "1024"]}}, "is_flash_attention": true, "mask_type": "{mask}"}}}}')  # fmt: skip
    return f"""HloModule m

ENTRY %main (q: bf16[1,1024,8,64], k: bf16[1,1024,2,64], v: bf16[1,1024,2,64]) -> (bf16[1,8,1024,64], f32[1,8,1024], u8[0]) {{
  %q = bf16[1,1024,8,64]{{3,2,1,0}} parameter(0)
  %k = bf16[1,1024,2,64]{{3,2,1,0}} parameter(1)
  %v = bf16[1,1024,2,64]{{3,2,1,0}} parameter(2)
  ROOT %attention = (bf16[1,8,1024,64]{{3,1,2,0}}, f32[1,8,1024]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="{target}", backend_config={config}
}}
"""


@pytest.mark.parametrize("target, products", [("__cudnn$fmhaSoftmax", 2), ("__cudnn$fmhaSoftmaxBackward", 5)])
def test_cudnn_flash_attention_counts_its_products_over_the_scores(target, products):
    """XLA counts no FLOPs in cuDNN's attention: the roofline counts 2 x scores x head_dim per product
    (the forward's q k^T and p v; the backward's five), half of them under a causal mask."""
    full = rl.roofline(_flash(target, "NO_MASK"), TOY)
    assert full.flops == products * 2 * (8 * 1024 * 1024) * 64
    causal = rl.roofline(_flash(target, "CAUSAL"), TOY)
    assert causal.flops == full.flops / 2
    assert causal.seconds == pytest.approx(max(causal.bytes / 1e9, causal.flops / 2e9) + 1.0)  # bf16's peak


# A projection as XLA:TPU writes it inside a step (the 8b LM's q, cut down): x (64 tokens, 32 features,
# a spatial dimension of 1) convolved with the kernel (4 heads as a window, 16 outputs, 32 inputs),
# the window sliding over that dimension padded by 3 on each side: one tap of each window reads x.
PADDED_WINDOW = """HloModule m

ENTRY %main (x: bf16[64,32,1], w: bf16[4,16,32]) -> bf16[64,4,16] {
  %x = bf16[64,32,1]{0,1,2} parameter(0)
  %w = bf16[4,16,32]{2,1,0} parameter(1)
  ROOT %convolution.125 = bf16[64,4,16]{0,2,1} convolution(%x, %w), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
}
"""


def test_a_projection_written_as_a_padded_window_counts_only_the_taps_that_read_data():
    assert rl.roofline(PADDED_WINDOW, TOY).flops == 2 * 64 * 32 * (4 * 16)  # x (64, 32) @ w (32, 64)

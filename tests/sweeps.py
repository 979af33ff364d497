"""What the default run keeps of each sweep: one case per claim; the rest run with ``-m slow``.

A sweep is a test parametrized over many cases that prove the same claim on other inputs (every
backend x every pruning option, every CPU ISA x every block shape). The default run keeps the cases
below (``fnmatch`` globs over the parameter id, the part of the test id in brackets); every other
case of the test is marked ``slow`` by ``tests/conftest.py``. ``python -m pytest -m slow`` runs
what is left out, ``python -m pytest -m ""`` everything.
"""

# test (file::function) -> parameter ids the default run keeps.
DEFAULT_CASES: dict[str, tuple[str, ...]] = {
    # Every option on the accelerators' backend (xla); each other backend (the batched column path
    # too) on a global, a padded column and a quantized case.
    "tests/bsr_jax/test_linear.py::test_grads_match_independent_reference": (
        "xla-l*", "xla-t*", "xla-bfloat16-*", "xla-i*", "xla-f*", "xla-s*",
        "cpu-l2-global-16", "cpu-l1-column-8x4-padded-bf16", "cpu-int8-storage-column-16",
        "pallas-l2-global-16", "pallas-int8-storage-column-16",
        "xla-batched-l1-column-8x4-padded-bf16", "xla-batched-int8-storage-column-16",
        "reference-l2-global-16", "reference-stochastic-l1-column-int8",
    ),
    # Each format on one shape, int4 (the recommended storage) on all three.
    "tests/bsr_jax/test_storage.py::test_rows_layout_holds_what_the_blocks_layout_holds": ("*-shape0-block0", "int4-shape2-*"),
    "tests/bsr_jax/test_storage.py::test_int4_packs_two_values_a_byte_and_round_trips": ("block0", "block3"),
    # Both compressions, strides and kernel sizes; explicit paddings with -m slow.
    "tests/bsr_jax/test_conv.py::test_gradients": ("1-SAME-3-*", "2-VALID-3-*", "2-padding11-3-*", "1-VALID-1-*"),
    "tests/bsr_jax/test_pallas_backend.py::test_pallas_dw_matches_reference": ("float32-shape0-*", "bfloat16-shape1-*", "*-int8"),
    "tests/pallas_kernels/test_bsr_matmul.py::test_matches_reference_and_masked_dense": ("*-float32", "one block-bfloat16"),
    "tests/pallas_kernels/test_bsr_t_matmul.py::test_matches_reference_and_masked_dense": ("*-float32", "one block-bfloat16"),
    # The fused kernels interpreted: each storage once, each dtype once (a 64-wide tile with -m slow).
    "tests/pallas_kernels/test_quantized_matmul.py::test_codes_are_bsr_jaxs_blocks_and_products_match": (
        "int8-128-float32", "int4-128-bfloat16"),
    "tests/bsr_jax/test_fused.py::test_fused_gives_the_unfused_gradients_and_the_dense_forward": (
        "int8-256-float32", "int4-256-bfloat16", "int8-64-bfloat16"),
    "tests/bsr_jax/test_elementwise.py::test_scale_shift_grads_match_independent_reference": (
        "l2-global-16", "l1-column-8x4-padded-bf16", "int8-storage", "stochastic-column-int8"),
    "tests/bsr_jax/test_format.py::test_global_selection_keeps_topk_blocks": ("shape0-*", "shape2-block2-l1"),
    # The C++ kernels: every block case in f32 and int4 on AVX2 (every x86-64 CI machine has it),
    # each storage on two cases, two cases on the other ISAs.
    "tests/cpu_kernels/test_cpu_bsr_t_matmul.py::test_matches_reference_of_dequantized_blocks": (
        "*-float32-avx2", "*-int4-avx2", "one block-*-avx2", "block 3x5, odd sides-int*", "several, empty column-int4-*"),
    "tests/cpu_kernels/test_cpu_bsr_t_matmul.py::test_multithreaded_result_is_deterministic": ("int4-avx2",),
    "tests/cpu_kernels/test_cpu_quantize_blocks.py::test_bitwise_equal_to_the_jitted_reference": (
        "whole blocks-*-avx2", "padded rows and columns-*-avx2", "1x1 blocks-int4-avx2", "odd block 3x5-*"),
    "tests/cpu_kernels/test_cpu_backend.py::test_cpu_backend_matches_reference_backend": ("*-0.5-avx2", "None-0.0-avx2"),
    "tests/cpu_kernels/test_cpu_backend.py::test_cpu_backend_matches_float64_reference": ("16-int8", "block1-None"),
    # Model constructors: the smallest of each family; the ImageNet-sized ones with -m slow.
    "tests/train/test_models.py::test_shapes_and_param_counts": ("s12-32-4-100", "tiny-32-4-10"),
    # One model per claim where another test holds the same claim for the others (the LM: test_lm_model,
    # test_custom_layers' gpt2 and llama forms).
    "tests/bsr_jax/test_compress.py::test_residual_bytes_of_the_issue_configuration": ("vit-*",),
    "tests/bsr_jax/test_lean.py::test_third_party_models_forward_bits_gradients_and_bytes": ("vit",),
    "tests/bsr_jax/test_compress.py::test_sparsity_zero_rules_give_dense_gradients": ("vit",),
    # GPT-2's form (custom projections, tied head) by default; Llama's (hand-written RMSNorm,
    # SwiGLU) with -m slow, whose lean forms test_hand_written_forms_are_lean holds by default.
    "tests/bsr_jax/test_custom_layers.py::test_every_projection_routed_forward_bitwise_and_only_kernel_grads_approximate": ("gpt2-*",),
    "tests/bsr_jax/test_custom_layers.py::test_residual_bytes_fall": ("gpt2-*",),
    # Approximate dx: a norm's and SwiGLU's input by default; attention's (7.5 s) with -m slow.
    "tests/bsr_jax/test_dx.py::test_each_kind_is_approximate_within_its_bound_and_exact_when_its_path_is_off": ("norm", "swiglu"),
    "tests/train/test_cli_errors.py::test_data_not_found_says_the_cause_first_in_a_short_line": ("empty", "cifar-10-python.tar.gz"),
    # The compressed model's step (the harder case) by default.
    "tests/bsr_jax/test_head_loss.py::test_h100_step_holds_no_logits_at_its_peak": ("True",),
    "tests/train/test_lm_model.py::test_lean_pass_reaches_inside_scan": ("True",),
    "tests/train/test_models.py::test_residual_bytes_of_one_block": ("0.7-True",),
    # A vocabulary the chunk does not divide (the padded last chunk) is the case that can go wrong.
    "tests/bsr_jax/test_losses.py::test_loss_and_gradients_equal_the_plain_form": ("37",),
    "tests/bsr_jax/test_head_loss.py::test_nanogpt_loss_inside_the_model": ("float32-*",),
    "tests/bsr_jax/test_head_loss.py::test_llama_loss_outside_the_model_through_the_function_transform": ("integer_loss-True",),
    # Grouped heads under scan (MQA) holds the claim; MHA and unscanned GQA with -m slow.
    "tests/train/test_lm_attention.py::test_flash_attention_computes_what_the_hand_written_one_does": ("1-True",),
    # docs/planner.md's blocks run plan() searches (a minute on 2 cores): test_planner holds each
    # claim they print (fits the budget, the table, the error), so the page runs with -m slow.
    # docs/memory.md's and docs/usage.md's blocks (21 s) compile deviceless steps whose claims
    # test_compiled and test_compress hold: -m slow. The README's blocks always run.
    "tests/test_docs.py::test_python_blocks_run_as_printed": ("README.md", "docs/conv.md"),
}

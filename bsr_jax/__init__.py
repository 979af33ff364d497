"""bsr-jax: block-sparse activation residuals for memory-efficient training in JAX/Flax."""

# First, before jax starts: no plugin noise on a machine without an accelerator (see its docstring).
from bsr_jax import _environment  # noqa: F401  isort: skip
from bsr_jax.rewrite.compress import compress_model
from bsr_jax.core.names import name_policy, tensor_names
from bsr_jax.ops.head_loss import chunked_head_loss
from bsr_jax.ops.conv import Conv, compressed_conv
from bsr_jax.ops.elementwise import bsr_scale_shift
from bsr_jax.storage.format import BlockSparse, capacity_for, from_dense
from bsr_jax.storage.pruning import Pruning
from bsr_jax.ops.layers import Affine, Dense, LayerScale
from bsr_jax.rewrite.lean import lean_neighbours
from bsr_jax.ops.linear import bsr_linear
from bsr_jax.storage.pooling import Pooling
# Submodules the README uses as attributes (bsr_jax.schedules.layer_sparsity, ...); each costs ~1 ms.
from bsr_jax.ops import dx
from bsr_jax.ops import head_loss
from bsr_jax.ops import losses
from bsr_jax.rewrite import presets
from bsr_jax.storage import quantize
from bsr_jax.measure import roofline
from bsr_jax.rewrite import schedules
from bsr_jax.rewrite import sensitivity
from bsr_jax.core import sharding
from bsr_jax.rewrite.rules import LayerPlan, Rule, layer_table, pruning_plan, use_rules
from bsr_jax.core.layer_table import LayerTable
from bsr_jax.measure.report import ResidualReport, residual_report
from bsr_jax.measure.compiled import CompiledStep, compiled_memory
from bsr_jax.planning import search as planner
from bsr_jax.planning.microbatch import accumulated_value_and_grad
from bsr_jax.planning.search import NoFit, Plan, plan
from bsr_jax.measure.memory import CompiledMemory, ResidualBytes, program_order_peak, remat_policy, residual_bytes
# Modules earlier docs cited as bsr_jax.compiled.target_mesh, bsr_jax.lean.lean_neighbours, ...:
# still reachable under those names (their homes are now the parts above).
from bsr_jax.measure import compiled  # noqa: F401
from bsr_jax.rewrite import lean, lean_graph  # noqa: F401
from bsr_jax.storage import format  # noqa: F401, A004
from bsr_jax.planning import nnx as planner_nnx  # noqa: F401

__all__ = [
    "compress_model",
    "name_policy",
    "tensor_names",
    "chunked_head_loss",
    "head_loss",
    "plan",
    "NoFit",
    "Plan",
    "accumulated_value_and_grad",
    "planner",
    "Conv",
    "Pooling",
    "dx",
    "losses",
    "presets",
    "roofline",
    "quantize",
    "schedules",
    "sensitivity",
    "sharding",
    "compressed_conv",
    "Affine",
    "LayerPlan",
    "LayerTable",
    "layer_table",
    "Rule",
    "pruning_plan",
    "use_rules",
    "LayerScale",
    "Pruning",
    "BlockSparse",
    "CompiledMemory",
    "CompiledStep",
    "Dense",
    "ResidualBytes",
    "bsr_linear",
    "bsr_scale_shift",
    "capacity_for",
    "compiled_memory",
    "from_dense",
    "program_order_peak",
    "remat_policy",
    "residual_bytes",
    "lean_neighbours",
    "ResidualReport",
    "residual_report",
]

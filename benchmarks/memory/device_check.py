"""The deviceless figures against a real GPU: compiled peak and modelled step time of a full
training step beside the GPU's own ``peak_bytes_in_use`` and the measured step time.

Run on a machine with one NVIDIA GPU (docs/RESULTS.md section 13 holds what it printed). Each
(model, setting) runs in its own process, so that ``memory_stats()["peak_bytes_in_use"]`` (which
never resets) is that step's alone. A row: the step compiled for the local GPU as a user's
``jax.jit`` compiles it (XLA's defaults: autotuning, Triton GEMMs) and as ``bsr_jax.compiled_memory``
compiles deviceless (``_GPU_OPTIONS``, no autotuning, and cuBLAS GEMMs: ``triton_gemm=False``, the
instrument of section 13); the compiler's peak and the
roofline's modelled time (``bsr_jax.measure.roofline`` with the H100's figures) of each; then the
default program run: 3 warm-up steps and the median of ``--reps`` timed steps (each waited for),
and the allocator's peak.

    python -m benchmarks.memory.device_check --models resmlp-s12 lm-12x768 --settings dense remat int4 --json out.json

A setting ``plan:LABEL`` runs a planner's choice as ``benchmarks.plans.plan_table`` writes it
(``Plan.label`` and its micro-batch count: ``"9xremat + 2xlean + 1xkeep, rest lean"``,
``"12xkeep, rest keep, 4 micro-batches"``, ``"..., chunked loss"``), built as the planner builds its
candidates (``planner.Linen``'s ``assemble`` and ``step``, plan_table's loss): so ``plan:12xkeep, rest
keep`` is the dense step those plans are measured against.

Writes docs/RESULTS.md sections 13 and 13.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 2**20


def plan_step(model_name: str, label: str, loss_chunk: int):
    """A plan's step from its label (see the module docstring), as ``step_args`` returns a setting's."""
    import jax
    import optax

    import bsr_jax
    from benchmarks.memory.compiled_memory import MODELS
    from benchmarks.plans import plan_table
    from bsr_jax.planning import search as planner

    blocks, rest, *more = label.split(", ")
    choices = [name for run in blocks.split(" + ") for count, name in [run.split("x", 1)] for _ in range(int(count))]
    microbatches = next((int(m.split()[0]) for m in more if m.endswith("micro-batches")), 1)
    model, shape, classes, context = MODELS[model_name]("dense")
    loss_fn = bsr_jax.chunked_head_loss(plan_table._loss_fn, chunk=loss_chunk) if "chunked loss" in more else plan_table._loss_fn
    x, y = plan_table._batch(shape)
    family = planner.Linen(model, loss_fn, (x, y), None, None)
    if len(choices) != len(family.blocks):
        raise ValueError(f"{label!r}: {len(choices)} choices for {len(family.blocks)} blocks")
    step = family.step(family.assemble(choices, rest.removeprefix("rest ")), optax.adamw(1e-3), loss_fn, microbatches)
    opt = jax.eval_shape(optax.adamw(1e-3).init, family.params)
    return model, shape, classes, context, step, (family.state, opt, x, y)


def one(model_name: str, setting: str, reps: int, loss_chunk: int = 1024, deviceless_options: bool = True) -> dict:
    """Compile, run and time one step in this process (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.memory.compiled_memory import MODELS, step_args
    from bsr_jax.measure import compiled as compiled_lib
    from bsr_jax.measure import roofline

    if setting.startswith("plan:"):
        model, shape, classes, context, step, abstract = plan_step(model_name, setting[len("plan:"):], loss_chunk)
    else:
        built = MODELS[model_name](setting)
        if built is None:
            return dict(model=model_name, setting=setting, skipped="setting not defined for this model")
        model, shape, classes, context = built
        step = None
    with context:
        if step is None:
            step, abstract = step_args(model, shape, classes)
        # Initialised as step_args does it abstractly: the model's own init, adamw's state.
        variables = jax.jit(model.init)({"params": jax.random.key(0), "pruning": jax.random.key(1)}, jnp.zeros((1,) + shape[1:], abstract[2].dtype))
        opt = optax.adamw(1e-3).init(variables["params"])
        x_spec, y_spec = abstract[2:]
        high = classes if jnp.issubdtype(x_spec.dtype, jnp.integer) else None
        x = (jax.random.randint(jax.random.key(1), x_spec.shape, 0, high, x_spec.dtype) if high
             else jax.random.normal(jax.random.key(1), x_spec.shape, x_spec.dtype))
        y = jax.random.randint(jax.random.key(2), y_spec.shape, 0, classes, y_spec.dtype)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        lowered = jitted.lower(variables, opt, x, y)
        t0 = time.perf_counter()
        default = lowered.compile()
        compile_s = time.perf_counter() - t0
        programs = [("default", default)]
        if deviceless_options:
            programs.append(("deviceless_options", lowered.compile(compiled_lib._GPU_OPTIONS | {"xla_gpu_enable_triton_gemm": False})))
    row = dict(model=model_name, setting=setting, device=jax.devices()[0].device_kind, jax=jax.__version__, compile_s=compile_s)
    for name, program in programs:
        analysis = program.memory_analysis()
        modelled = roofline.roofline(program.as_text(), "h100")
        row[f"{name}_peak_mib"] = int(getattr(analysis, "peak_memory_in_bytes", 0)) / MIB
        row[f"{name}_modelled_ms"] = modelled.seconds * 1e3
    del programs
    state = (variables, opt)
    times = []
    for i in range(3 + reps):
        t0 = time.perf_counter()
        *state, loss = default(*state, x, y)
        jax.block_until_ready(loss)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    row.update(step_ms=statistics.median(times) * 1e3, step_ms_min=min(times) * 1e3, loss=float(loss),
               peak_bytes_in_use_mib=stats.get("peak_bytes_in_use", 0) / MIB, bytes_limit_mib=stats.get("bytes_limit", 0) / MIB)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resmlp-s12", "lm-12x768"])
    parser.add_argument("--settings", nargs="+", default=["dense", "remat", "int4"])
    parser.add_argument("--rows", nargs="+", metavar="MODEL::SETTING", help="these (model, setting) pairs, in order, instead of --models x --settings")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default="device_check.json")
    parser.add_argument("--loss-chunk", type=int, default=1024, help="the chunk of a plan's chunked loss (plan_table's --loss-chunk)")
    parser.add_argument("--no-deviceless-options", action="store_true",
                        help="compile each step once (the device's defaults), not again with the deviceless options")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(*args.one, args.reps, args.loss_chunk, not args.no_deviceless_options)), flush=True)
        return
    rows = []
    # benchmarks.memory.compiled_memory defaults jax to the CPU (it compiles deviceless): start the GPU.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cuda"))
    pairs = [row.split("::", 1) for row in args.rows] if args.rows else [(m, s) for m in args.models for s in args.settings]
    for model, setting in pairs:
        cmd = [sys.executable, "-m", "benchmarks.memory.device_check", "--one", model, setting, "--reps", str(args.reps),
               "--loss-chunk", str(args.loss_chunk)] + (["--no-deviceless-options"] if args.no_deviceless_options else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[0]) if found else dict(model=model, setting=setting, error=done.stderr[-2000:])
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("| model | setting | XLA peak (default) | peak_bytes_in_use | XLA peak (deviceless options) | modelled ms (default) | modelled ms (deviceless options) | measured ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" in r:
            print(f"| {r['model']} | {r['setting']} | {r['default_peak_mib']:.0f} | {r['peak_bytes_in_use_mib']:.0f} | "
                  f"{r.get('deviceless_options_peak_mib', float('nan')):.0f} | {r['default_modelled_ms']:.2f} | "
                  f"{r.get('deviceless_options_modelled_ms', float('nan')):.2f} | {r['step_ms']:.2f} |")
        else:
            print(f"| {r['model']} | {r['setting']} | {r.get('skipped') or 'error: ' + r.get('error', '')[-300:]} |")


if __name__ == "__main__":
    main()

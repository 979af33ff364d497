"""Per-layer weight-gradient error of int8 / int4 storage at sparsity 0, on the small third-party models.

For every model of ``tests/third_party_models.py`` (Mixer, ViT, lm1b LM, GPT-2, Llama at issue 13's
configuration: 4 layers, width 128, batch 8; parameters at their init plus 0.05 normal noise, inputs
normal images / random tokens from fixed seeds), ``compress_model(model, Rule("*", Pruning(0.0,
storage_dtype=d)))`` keeps every linear and conv input in ``d`` with per-block scales (``--block``, 16x16) and
rounds to nearest. Per parameter whose gradient storage changes (the ``ndim >= 2`` leaves whose
gradient differs at all: kernels, tied embeddings; not biases), the relative Frobenius error ``||dW_d - dW|| / ||dW||`` against plain autodiff of
the unmodified model is reported, with the spread over layers (min / median / max). Everything else
(biases, norm scales, dx) is exact.

    python -m benchmarks.accuracy.storage_error            # table on stdout, JSON in benchmarks/results/

Writes docs/RESULTS.md section 3b.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from benchmarks.run_info import run_metadata, write_json
from bsr_jax import Pruning, Rule, compress_model

from tests import third_party_models as tpm  # noqa: E402

STORAGE = ("int8", "int4")


def _models(c: tpm.Config):
    """name -> (model, input, loss of the output)."""
    classify = lambda out: tpm.classifier_loss(out, tpm.labels(c))
    language = lambda out: tpm.lm_loss(out, tpm.tokens(c))
    return {
        "mixer": (tpm.mixer(c), tpm.images(c), classify),
        "vit": (tpm.vit(c), tpm.images(c), classify),
        "lm": (tpm.lm(c), tpm.tokens(c), language),
        "gpt2": (tpm.gpt2(c), tpm.tokens(c), language),
        "llama": (tpm.llama(c), tpm.tokens(c), language),
    }


def layer_errors(model, x, loss, storage: str, block: tuple[int, int] = (16, 16)) -> dict[str, float]:
    """Relative Frobenius error of each ``ndim >= 2`` parameter's gradient, by parameter path."""
    params = tpm.jitter(model.init(jax.random.key(0), x))
    grad = lambda m: jax.jit(jax.grad(lambda p: loss(m.apply(p, x))))(params)
    dense, stored = grad(model), grad(compress_model(model, Rule("*", Pruning(0.0, block=block, storage_dtype=storage))))
    errors = {}
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(stored)[0], jax.tree.leaves(dense)):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        error = float(np.linalg.norm(g - w) / np.linalg.norm(w))
        # Biases (attention's are 2-D) and leaves storage does not touch (position and input
        # embeddings: float reassociation only, < 1e-5) are left out.
        if g.ndim >= 2 and not name.endswith("bias") and error > 1e-5:
            errors[name] = error
    return errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/storage_error.json")
    parser.add_argument("--block", default="16x16", type=lambda t: tuple(int(v) for v in t.split("x")),
                        help="block ROWSxCOLS of the per-block scales (default 16x16; 1x128: row blocks, see docs/memory.md)")
    args = parser.parse_args(argv)
    meta = run_metadata()
    rows, layers = [], {}
    print(f"{'model':<6} {'storage':<7} {'layers':>6} {'min':>7} {'median':>7} {'max':>7}  worst layer")
    for name, (model, x, loss) in _models(tpm.ISSUE).items():
        for storage in STORAGE:
            errors = layer_errors(model, x, loss, storage, args.block)
            values = sorted(errors.values())
            worst = max(errors, key=errors.get)
            rows.append(dict(model=name, storage=storage, layers=len(values), min=values[0], median=statistics.median(values), max=values[-1], worst=worst))
            layers[f"{name}/{storage}"] = errors
            print(f"{name:<6} {storage:<7} {len(values):>6} {values[0]:>7.4f} {statistics.median(values):>7.4f} {values[-1]:>7.4f}  {worst}")
    every = {s: [e for key, errs in layers.items() if key.endswith(s) for e in errs.values()] for s in STORAGE}
    for s, values in every.items():
        print(f"all    {s:<7} {len(values):>6} {min(values):>7.4f} {statistics.median(values):>7.4f} {max(values):>7.4f}")
    write_json(args.out, meta, dict(config=str(tpm.ISSUE), block=args.block, rows=rows, layers=layers))


if __name__ == "__main__":
    main()

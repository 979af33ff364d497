"""The package's parts import one way only (docs/architecture.md): each module may import its own
part and the parts below it, never a part above; the top level holds ``__init__``,
``_environment`` and the parts; no module outside ``core/jax_private.py`` imports ``jax._src``."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "bsr_jax"
# Lowest first: the order docs/architecture.md draws.
PARTS = ("core", "storage", "backends", "ops", "measure", "rewrite", "planning")
MAX_LINES = 400


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _part(module: str) -> str | None:
    """``bsr_jax.ops.linear`` -> ``ops``; the package itself and ``_environment`` -> ``None``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PARTS else None


def _imports(path: pathlib.Path):
    """Every ``bsr_jax`` module a file imports (at top level or inside functions), with its line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{a.name}", node.lineno) for a in node.names)


def test_top_level_holds_only_the_face_and_the_parts():
    top = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith(("__pycache__", ".")))
    assert top == sorted(["__init__.py", "_environment.py", *PARTS])
    for part in PARTS:
        assert ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text())), f"{part}/__init__.py says what it owns"


def test_no_import_runs_upward():
    upward = []
    for path in _modules():
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        here = _part(name)
        if here is None:
            continue
        for target, line in _imports(path):
            segments = target.split(".")
            if segments[0] != "bsr_jax" or len(segments) == 1 or segments[1] == "_environment":
                continue
            where = f"{path.relative_to(PACKAGE)}:{line} ({here}) imports {target}"
            if segments[1] not in PARTS:
                upward.append(f"{where}: the package face, above every part")
            elif PARTS.index(segments[1]) > PARTS.index(here):
                upward.append(f"{where}: a higher part")
    assert not upward, "\n".join(upward)


def test_private_jax_in_one_module():
    users = [str(p.relative_to(PACKAGE)) for p in _modules() if any(t.startswith("jax._src") for t, _ in _imports(p))]
    assert users == ["core/jax_private.py"], users


def test_modules_are_short():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_names_earlier_docs_cited_still_resolve():
    import functools

    import bsr_jax

    cited = ["bsr_jax.compiled.compile_for", "bsr_jax.compiled.target_mesh", "bsr_jax.format.from_dense",
             "bsr_jax.lean.lean_neighbours", "bsr_jax.lean_graph", "bsr_jax.planner_nnx.find_blocks",
             "bsr_jax.planner.find_blocks", "bsr_jax.quantize.quantize_rows", "bsr_jax.sharding.batch_axes"]  # fmt: skip
    for name in cited:
        functools.reduce(getattr, name.split(".")[1:], bsr_jax)

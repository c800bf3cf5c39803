"""The project's shape, checked: layers, cycles, family names in the engine, function length.

The rules (docs/architecture.md):
- ``generate_flax.py`` -> ``families`` -> ``engine`` -> the kernel (``custom_splash_attention``
  and its package ``splash``); nothing imports upward. Inside the engine the wings stack run <
  files < weights < programs < pipeline < {dry_run, serve}: each imports only itself and the
  wings below it, and the two top wings are siblings (neither imports the other).
- The engine and the server import nothing from ``generate_flax.py``: the script asks for a
  run, the engine runs it.
- No import cycle between our modules. Function-local imports count as edges, and our own
  modules are imported at module top (only third-party imports may be deferred).
- The engine names no model family: not in a string literal, an identifier, an attribute or
  an imported module path (docstrings and comments may). A family arrives as a
  ``families.ModelFamily`` value.
- No function over 80 lines, the kernel's included; ``generate_flax.py`` at most 500 lines.

The checks read the source with ``ast`` (nothing is imported), so they see imports inside
functions, which import-linter's static graph also sees but cannot tell from top-level ones.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNEL = "custom_splash_attention"
KERNEL_PACKAGE = "splash"
# Engine wings, bottom to top; a tuple of names is one rank of siblings.
WINGS = ("run", "files", "weights", "programs", "pipeline", ("dry_run", "serve"))
# Words that name a model family; a family's own module is the only place for them in code.
FAMILY_WORDS = {"wan", "hunyuan", "hunyuanvideo", "ltx", "ltxvideo"}
MAX_FUNCTION_LINES = 80
MAX_SCRIPT_LINES = 500


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def project_modules() -> dict[str, pathlib.Path]:
    """{dotted name: path} of the code the rules cover (not tests, tools or benchmarks)."""
    paths = [ROOT / "generate_flax.py", ROOT / f"{KERNEL}.py",
             *sorted((ROOT / KERNEL_PACKAGE).rglob("*.py")),
             *sorted((ROOT / "engine").rglob("*.py")), *sorted((ROOT / "families").rglob("*.py"))]
    return {module_name(p): p for p in paths}


def wing_rank(wing: str) -> int:
    """1 + the rank of an engine wing (siblings share one)."""
    for rank, names in enumerate(WINGS):
        if wing == names or wing in names:
            return 1 + rank
    raise AssertionError(f"expected an engine wing of {WINGS}, got {wing!r}")


def layer(module: str) -> tuple[int, str]:
    """(rank, group): a module may import only modules of a lower rank or of its own group.
    The kernel's public face and its package are one group: the cycle test keeps the package
    from importing the face."""
    if module == KERNEL or module.split(".")[0] == KERNEL_PACKAGE:
        return 0, KERNEL
    if module.startswith("engine."):
        wing = module.split(".")[1]
        return wing_rank(wing), f"engine.{wing}"
    if module == "engine":
        return 1, "engine"
    if module == "families" or module.startswith("families."):
        return 1 + len(WINGS), "families"
    if module == "generate_flax":
        return 2 + len(WINGS), "generate_flax"
    raise AssertionError(f"expected a module of the layered code, got {module!r}")


def imports(tree: ast.AST, module: str, known: set[str],
            package: bool = False) -> list[tuple[str, int, bool]]:
    """(imported project module, line, at module top) for every import in ``tree``;
    ``package``: ``module`` is a package's ``__init__`` (relative imports start there)."""
    top = {id(n) for n in getattr(tree, "body", ())}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if package else 0)]
                base = ".".join([*parts, base] if base else parts)
            # "from engine.files import report" imports the module engine.files.report;
            # "from engine.run.errors import fail" imports engine.run.errors.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in dict.fromkeys(names):
            if name in known:
                out.append((name, node.lineno, id(node) in top))
    return out


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = project_modules()
    known = set(mods)
    return {m: imports(ast.parse(p.read_text()), m, known, p.name == "__init__.py")
            for m, p in mods.items()}


def test_modules_are_all_layered():
    for module in project_modules():
        layer(module)


def test_no_import_points_up_the_layers():
    wrong = []
    for module, edges in graph().items():
        rank, group = layer(module)
        for target, line, _ in edges:
            t_rank, t_group = layer(target)
            # Importing a package's own __init__ (e.g. "families") from inside it is allowed.
            if t_group == group or t_rank < rank or (group == "families" and target == group):
                continue
            wrong.append(f"{module}:{line} imports {target} (layer {t_group} is not below "
                         f"{group})")
    assert not wrong, "\n".join(wrong)


def test_engine_and_server_import_nothing_from_the_script():
    wrong = [f"{module}:{line} imports generate_flax" for module, edges in graph().items()
             if module != "generate_flax" for target, line, _ in edges
             if target == "generate_flax"]
    assert not wrong, "\n".join(wrong)


def test_top_wings_are_siblings():
    assert layer("engine.serve.app")[0] == layer("engine.dry_run.fit")[0]
    assert layer("engine.serve.app")[1] != layer("engine.dry_run.fit")[1]
    assert layer("engine.pipeline.stages")[0] < layer("engine.serve.model")[0]
    assert layer("engine.programs.denoise")[0] < layer("engine.pipeline.stages")[0]
    assert layer("splash.kernel") == layer(KERNEL)


def test_own_imports_are_at_module_top():
    inside = [f"{module}:{line} imports {target} inside a function"
              for module, edges in graph().items() for target, line, top in edges if not top]
    assert not inside, "\n".join(inside)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), plus self-loops."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    edges = {m: {t for t, _, _ in e if t != m} for m, e in graph().items()}
    # A package's __init__ that registers its submodules is not a cycle with them when they
    # import only its siblings; an edge to the package itself would be, and counts.
    assert cycles(edges) == []


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def words(text: str) -> set[str]:
    """Lower-case words of ``text``, splitting snake_case, CamelCase and digits
    ("WanLoraLoaderMixin" -> wan, lora, loader, mixin; "Wan2.2" -> wan)."""
    return {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", text)}


def family_names_in(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = None if id(node) in docstrings else node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            text = node.name
        elif isinstance(node, ast.alias):
            text = f"{node.name} {node.asname or ''}"
        elif isinstance(node, ast.ImportFrom):  # "from diffusers...autoencoder_kl_wan import x"
            text = node.module
        elif isinstance(node, ast.arg):
            text = node.arg
        else:
            continue
        if text and words(text) & FAMILY_WORDS:
            found.append((getattr(node, "lineno", 0), text[:80]))
    return found


def test_engine_names_no_family():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
             for path in sorted((ROOT / "engine").rglob("*.py"))
             for line, text in family_names_in(ast.parse(path.read_text()))]
    assert not wrong, "\n".join(wrong)


def test_family_name_finder():
    src = ('"""Wan is fine in a docstring."""\n'
           'x = "Wan2.2 only"\ny = WanLoraLoaderMixin\nwant = "hunyuanvideo1.5"\nz = "wanted"\n'
           'from diffusers.models.autoencoders.autoencoder_kl_wan import patchify\n'
           'from diffusers.models import attention\n')
    assert sorted(line for line, _ in family_names_in(ast.parse(src))) == [2, 3, 4, 6]


def long_functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append((node.name, node.lineno, n))
    return out


@pytest.mark.parametrize("folder", ["engine", "families", KERNEL_PACKAGE, "tools", "benchmarks",
                                    "."])
def test_functions_are_short(folder):
    paths = sorted((ROOT / folder).rglob("*.py")) if folder != "." else \
        sorted(ROOT.glob("*.py"))
    wrong = [f"{p.relative_to(ROOT)}:{line} {name} is {n} lines (max {MAX_FUNCTION_LINES})"
             for p in paths
             for name, line, n in long_functions(ast.parse(p.read_text()))]
    assert not wrong, "\n".join(wrong)


def test_script_fits_its_budget():
    n = len((ROOT / "generate_flax.py").read_text().splitlines())
    assert n <= MAX_SCRIPT_LINES, f"generate_flax.py: expected <= {MAX_SCRIPT_LINES} lines, " \
                                  f"got {n}"


def test_relative_imports_resolve_to_modules():
    known = {"engine.files", "engine.files.report", "engine.run.errors"}
    src = "from . import report\nfrom ..run.errors import fail\n"
    assert [t for t, _, _ in imports(ast.parse(src), "engine.files.staging", known)] == [
        "engine.files.report", "engine.run.errors"]
    assert [t for t, _, _ in imports(ast.parse("from . import report\n"), "engine.files",
                                     known, package=True)] == ["engine.files.report"]

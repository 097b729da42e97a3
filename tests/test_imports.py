"""The library core stays free of orchestration and tracking dependencies, and of the demo package."""

import ast
import subprocess
import sys
from pathlib import Path

import lrkv_core


def _loaded(code: str, top: set[str]) -> set[str]:
    names = "','.join(sorted(m for m in sys.modules if m.split('.')[0] in " + repr(top) + "))"
    probe = f"import sys; {code}; print({names})"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(filter(None, out.stdout.strip().split(",")))


def test_core_imports_no_prefect_mlflow_boto3():
    """Importing lrkv_core loads no prefect or mlflow, and no boto3 beyond what its own dependencies load.

    (transformers imports accelerate, which imports boto3 whenever boto3 is installed, as it is for lrkv's
    S3 store: that is measured as the baseline; lrkv_core's own code is checked by the AST test below.)
    """
    core = "import lrkv_core, lrkv_core.conversion.pipeline, lrkv_kernels.latent_rope"
    assert _loaded(core, {"prefect", "mlflow"}) == set()
    aws = {"boto3", "botocore"}
    baseline = _loaded("import torch, transformers.quantizers.auto, safetensors, datasets, pyarrow", aws)
    assert _loaded(core, aws) <= baseline, "lrkv_core pulled in boto3 modules its dependencies do not"


def test_core_code_never_imports_orchestration_or_cloud_libraries():
    for path in sorted(Path(lrkv_core.__file__).parent.rglob("*.py")):  # lazy imports inside functions too
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad = {n.split(".")[0] for n in names} & {"prefect", "mlflow", "boto3", "botocore", "s3fs"}
            assert not bad, f"{path.name} imports {bad}"


def test_kernels_do_not_import_core():
    code = "import sys, lrkv_kernels.latent_rope; print('lrkv_core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_core_never_imports_demo():
    """lrkv_demo plugs into lrkv_core through entry points only: no lrkv_core module imports it."""
    code = (
        "import sys, pkgutil, importlib, lrkv_core;"
        "[importlib.import_module('lrkv_core.' + m.name) for m in pkgutil.iter_modules(lrkv_core.__path__)];"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lrkv_demo'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing lrkv_core pulled in: {out.stdout.strip()}"
    for path in sorted(Path(lrkv_core.__file__).parent.glob("*.py")):  # lazy imports inside functions too
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "lrkv_demo" for n in names), f"{path.name} imports lrkv_demo"


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lrkv_core": "lrkv_core", "lrkv_kernels": "kernels", "lrkv_demo": "demo", "lrkv_tasks": "tasks",
            "lrkv_flows": "flows"}  # fmt: skip
LAYER = {"lrkv_kernels": 0, "lrkv_core": 1, "lrkv_demo": 2, "lrkv_tasks": 3, "lrkv_flows": 4}


def _modules() -> dict[str, Path]:
    """Every project module by dotted name (packages as their ``__init__``)."""
    out = {}
    for name, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports, at any depth of its code (lazy imports inside functions too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import sub` imports the submodule sub; `from mod import name` imports mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != mod}
        graph[mod] = edges
    return graph


def test_the_import_graph_has_no_circles():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert len(graph) > 40  # the walk saw the project, not an empty tree


def test_imports_go_one_way():
    """flows → tasks → (demo) → lrkv_core → lrkv_kernels: no package imports one above it."""
    for mod, edges in _import_graph().items():
        for target in edges:
            src, dst = mod.split(".")[0], target.split(".")[0]
            assert LAYER[dst] <= LAYER[src], f"{mod} imports {target}: against the dependency direction"


def test_progress_outside_a_run_imports_no_prefect():
    """The CLI reports progress (building a builtin model) before it points Prefect at an API server; a
    Prefect imported then would keep settings without ``PREFECT_API_URL`` and start an ephemeral server."""
    code = "from lrkv_tasks.progress import step\nwith step('x') as advance:\n    advance(1, 2)"
    assert _loaded(code, {"prefect"}) == set()

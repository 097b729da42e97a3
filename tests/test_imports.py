"""The library core stays free of orchestration and tracking dependencies, and of the demo package."""

import ast
import subprocess
import sys
from pathlib import Path

import lrkv_core


def test_core_imports_no_prefect_mlflow_boto3():
    code = (
        "import sys, lrkv_core, lrkv_core.pipeline, lrkv_kernels.latent_rope;"
        "top = {'prefect', 'mlflow', 'boto3', 'botocore'};"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in top);"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"lrkv_core pulled in: {out.stdout.strip()}"


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

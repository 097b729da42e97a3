"""The library core stays free of orchestration and tracking dependencies."""

import subprocess
import sys


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

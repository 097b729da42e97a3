"""lrkv_core: the library. Math, model patching, latent cache, evaluation.

Depends on torch / transformers / safetensors / datasets / pyarrow only (never prefect, mlflow, boto3).

    import lrkv_core
    model = lrkv_core.convert(model, calibration_rows, lrkv_core.CompressionConfig(ratio=0.5))
    lrkv_core.save_compressed(model, "out/")
    model = lrkv_core.load_compressed("out/")
"""

from .allocation import ALLOCATORS
from .cache import LatentCache, cache_nbytes
from .conversion.convert import CompressionConfig, Conversion, convert, decompose_model, plan_conversion
from .decompositions import DECOMPOSITIONS
from .format import LrkvFormat
from .model import hf_quantizer  # noqa: F401  (registers the "lrkv" quant method with transformers)
from .model.io import load_compressed, save_compressed
from .model.loading import load_model
from .statistics import STATISTICS
from .version import __version__

__all__ = [
    "ALLOCATORS",
    "DECOMPOSITIONS",
    "STATISTICS",
    "CompressionConfig",
    "Conversion",
    "LatentCache",
    "LrkvFormat",
    "__version__",
    "cache_nbytes",
    "convert",
    "decompose_model",
    "load_compressed",
    "load_model",
    "plan_conversion",
    "save_compressed",
]

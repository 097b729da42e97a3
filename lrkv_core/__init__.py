"""lrkv_core: the library. Math, model patching, latent cache, evaluation.

Depends on torch / transformers / safetensors / datasets / pyarrow only (never prefect, mlflow, boto3).
"""

__version__ = "0.1.0"

from . import hf_quantizer  # noqa: E402,F401  (registers the "lrkv" quant method with transformers)
from .cache import LatentCache, cache_nbytes  # noqa: E402
from .io import load_compressed, save_compressed  # noqa: E402
from .models import load_model  # noqa: E402

__all__ = ["LatentCache", "cache_nbytes", "load_compressed", "load_model", "save_compressed", "__version__"]

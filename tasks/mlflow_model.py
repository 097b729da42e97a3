"""The pyfunc loader of lrkv's MLflow models (``loader_module`` in their MLmodel): no pickle involved.

``mlflow.pyfunc.load_model("models:/lrkv-<model>@champion")`` calls :func:`_load_pyfunc` with the model's
data directory, which is an lrkv compressed model directory; ``predict`` generates greedily. The model is
logged with :func:`signature`, whose params schema lets ``predict(rows, params={"max_new_tokens": 6})`` reach
:meth:`LrkvPyfunc.predict` (MLflow drops, with a warning, params a model's signature does not declare).

MLflow resolves ``models:/`` through its own global registry URI, which is ``./mlflow.db`` when nothing is
configured: :func:`lrkv_tasks.tracking.remote_refs.load_pyfunc` resolves the name in the registry lrkv logs to
instead (the local SQLite under ``$LRKV_HOME`` by default) and loads the downloaded model.
"""

from __future__ import annotations

from typing import Any

import torch

from lrkv_core.model.io import load_compressed

PARAMS = {"max_new_tokens": 16}  # predict's params and their defaults


class LrkvPyfunc:
    """A compressed model behind pyfunc's ``predict``: token id rows in, generated token id rows out."""

    def __init__(self, model_dir: str) -> None:
        self.model = load_compressed(model_dir)

    def predict(self, model_input: Any, params: dict | None = None) -> list[list[int]]:
        """Greedy continuation of each row of token ids (``params["max_new_tokens"]``, default 16)."""
        rows = model_input.values.tolist() if hasattr(model_input, "values") else list(model_input)
        new = int((params or {}).get("max_new_tokens", PARAMS["max_new_tokens"]))
        out = []
        with torch.no_grad():
            for row in rows:
                ids = torch.tensor([list(row)], dtype=torch.long)
                out.append(self.model.generate(ids, max_new_tokens=new, do_sample=False)[0].tolist())
        return out


def signature():
    """The MLflow model signature: inputs free-form (rows of token ids may differ in length), params typed."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec

    return ModelSignature(params=ParamSchema([ParamSpec(k, "long", v) for k, v in PARAMS.items()]))


def _load_pyfunc(data_path: str) -> LrkvPyfunc:
    return LrkvPyfunc(data_path)

"""Device names: what ``--device`` and ``LRKV_DEVICE`` accept, and the errors for what they do not."""

from __future__ import annotations

import pytest
import torch

from lrkv_core.model.loading import load_model, parse_device
from tests.support.models import tiny_model_dir


def test_names_and_auto():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert parse_device("auto", here=False) == torch.device("cuda")  # another host: the GPU it names
    assert parse_device("cuda:1", here=False) == torch.device("cuda", 1)
    for bad in ("tpu", "gpu", "cuda:x", ""):
        with pytest.raises(ValueError, match="unknown device"):
            parse_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_a_gpu_torch_cannot_see_is_refused():
    with pytest.raises(ValueError, match="sees no CUDA device"):
        parse_device("cuda")


def test_an_index_past_the_last_gpu_is_refused():
    with pytest.raises(ValueError, match="CUDA device"):
        parse_device(f"cuda:{torch.cuda.device_count()}")


def test_load_model_puts_the_model_on_the_device(tmp_path):
    model, _ = load_model(tiny_model_dir(tmp_path), device="auto")
    assert {p.device.type for p in model.parameters()} == {parse_device("auto").type}
    with pytest.raises(ValueError, match="unknown device"):
        load_model(tiny_model_dir(tmp_path), device="tpu")

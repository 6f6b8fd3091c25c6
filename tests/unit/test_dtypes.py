"""The one dtype table: config validation, the CLI and torch agree on it."""
import dataclasses

import pytest
import torch

from hpctrain.config import TrainConfig
from hpctrain.runtime.dtypes import DTYPE_NAMES, torch_dtype


def test_names_map_to_torch_dtypes_and_config_accepts_exactly_them():
    assert [torch_dtype(n) for n in DTYPE_NAMES] == [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["dtype"]
    assert tuple(field.metadata["choices"]) == DTYPE_NAMES


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="float32"):
        torch_dtype("int8")

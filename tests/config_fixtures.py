"""Helpers the test_config_*.py files share: the reference configs users copy, a stub model,
the message of a ConfigError, and loading then resolving a config dict."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerotrain.config import ConfigError, ZeroTrainConfig, load_config, resolve_config

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


class StubModel(nn.Module):
    """A model with one parameter of ``dtype`` and a Hugging Face-style ``config``."""

    def __init__(self, hidden_size: int | None = 64, dtype: torch.dtype = torch.float32, **config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, dtype=dtype))
        if hidden_size is not None:
            config["hidden_size"] = hidden_size
        self.config = SimpleNamespace(**config)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def resolve(data: dict, world_size: int = 2, **kwargs) -> ZeroTrainConfig:
    return resolve_config(load_config(data), world_size=world_size, **kwargs)

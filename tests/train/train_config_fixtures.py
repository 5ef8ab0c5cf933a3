"""Helpers the test_train_config_*.py files share: writing config files, a minimal model section,
the message of a ConfigError, and building the engine's config from a TrainConfig."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.train.config import TrainConfig
from zerotrain.train.zero_fill import build_engine_config

TINY = "model:\n  architecture: llama\n"


class HiddenSizeModel(nn.Module):
    """One fp32 parameter and a Hugging Face-style config with a hidden size."""

    def __init__(self, hidden_size: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))
        self.config = SimpleNamespace(hidden_size=hidden_size)


def with_model(text: str) -> str:
    """A config body (indented in the test) under a minimal model section."""
    return TINY + textwrap.dedent(text)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def engine(cfg: TrainConfig, world_size: int = 2, total_steps: int | None = 100, model=None):
    return build_engine_config(
        cfg, model=model or HiddenSizeModel(), world_size=world_size, device_type="cpu", total_steps=total_steps
    )

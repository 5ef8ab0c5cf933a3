"""Configuration: DeepSpeed-compatible schema, loading, "auto" resolution, batch arithmetic.

Typical use::

    cfg = load_config("ds_config.json")            # "auto" values kept as "auto"
    cfg = resolve_config(cfg, world_size=8, model=model,
                         auto_values={"optimizer.params.lr": 3e-4})
    cfg.train_micro_batch_size_per_gpu, cfg.zero_stage, cfg.compute_dtype
"""

from zerotrain.config.auto import resolve_batch_sizes, resolve_config
from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.unsupported import check_supported

__all__ = [
    "ConfigError",
    "ZeroTrainConfig",
    "check_supported",
    "load_config",
    "resolve_batch_sizes",
    "resolve_config",
]

"""Configuration: DeepSpeed-compatible schema, loading, "auto" resolution, batch arithmetic.

Typical use::

    cfg = load_config("ds_config.json")            # "auto" values kept as "auto"
    cfg = resolve_config(cfg, world_size=8, model=model,
                         auto_values={"optimizer.params.lr": 3e-4})
    cfg.train_micro_batch_size_per_gpu, cfg.zero_stage, cfg.compute_dtype
"""

from typing import TYPE_CHECKING

from zerotrain.config.lazy_exports import export_lazily

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
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

# On first use, so that `from zerotrain.config.errors import ...` (every command line module has
# one) does not build the whole schema: `zerotrain --help` stays fast.
export_lazily(__name__, {
    "resolve_batch_sizes": "zerotrain.config.auto",
    "resolve_config": "zerotrain.config.auto",
    "ConfigError": "zerotrain.config.errors",
    "load_config": "zerotrain.config.loader",
    "ZeroTrainConfig": "zerotrain.config.schema",
    "check_supported": "zerotrain.config.unsupported",
})

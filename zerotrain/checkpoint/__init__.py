"""Checkpoints: the on-disk format, reading any slice of it, and leaving zerotrain (consolidation, HF export)."""

from typing import TYPE_CHECKING

from zerotrain.config.lazy_exports import export_lazily

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
    from zerotrain.checkpoint.consolidate import consolidate, load_consolidated_state_dict
    from zerotrain.checkpoint.errors import CheckpointError
    from zerotrain.checkpoint.hf_export import export_hf
    from zerotrain.checkpoint.reader import CheckpointReader

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "consolidate",
    "export_hf",
    "load_consolidated_state_dict",
]

# On first use, so that registering `zerotrain consolidate`'s parser does not import torch.
export_lazily(__name__, {
    "consolidate": "zerotrain.checkpoint.consolidate",
    "load_consolidated_state_dict": "zerotrain.checkpoint.consolidate",
    "CheckpointError": "zerotrain.checkpoint.errors",
    "export_hf": "zerotrain.checkpoint.hf_export",
    "CheckpointReader": "zerotrain.checkpoint.reader",
})

"""Checkpoints: the on-disk format, reading any slice of it, and leaving zerotrain (consolidation, HF export)."""

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

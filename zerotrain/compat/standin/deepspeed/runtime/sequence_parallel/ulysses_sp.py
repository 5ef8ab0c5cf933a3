"""`deepspeed.runtime.sequence_parallel.ulysses_sp` (DeepSpeed 0.19.8's ALST names), on zerotrain.

The work is in zerotrain/sequence (attention, groups, batch slices) and zerotrain/compat
(`ulysses_hf.py`, `tiled_compute.py`, `tiled_logits_loss.py`); these are DeepSpeed's names and signatures for it.
"""

from zerotrain.compat.tiled_compute import TiledMLP, sequence_tiled_compute  # noqa: F401
from zerotrain.compat.tiled_logits_loss import TiledFusedLogitsLoss  # noqa: F401
from zerotrain.compat.ulysses_hf import register_with_transformers as _register
from zerotrain.sequence.peer_batches import PeerBatchLoader


class UlyssesSPAttentionHF:
    """Ulysses attention for Hugging Face transformers: use `register_with_transformers`."""

    def __init__(self, *args, **kwargs) -> None:
        from zerotrain.compat.unsupported_features import NotSupportedByZerotrain

        raise NotSupportedByZerotrain(
            "constructing UlyssesSPAttentionHF directly is not supported by zerotrain (the `deepspeed` package "
            "here is zerotrain's stand-in): call UlyssesSPAttentionHF.register_with_transformers(...), which wraps "
            "the model's attention kernel, or set sequence_parallel_size in the config."
        )

    register_with_transformers = staticmethod(_register)


class UlyssesSPDataLoaderAdapter(PeerBatchLoader):
    """Wraps a DataLoader that gives each rank its own batch: yields this rank's slice of every
    sequence-parallel peer's batch in turn (`len` = len(dl) * sp_world_size)."""

"""Plain tensor copies of a state dict, safe to save on their own."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copies every tensor in `item` (nested dicts, lists, tuples) to `device`, detached.

    A tensor that is a view of a larger buffer (a parameter inside a flat bucket) would
    otherwise be saved with the whole buffer; the copy owns exactly its own elements.
    """
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item

"""`deepspeed.compression.helper`: the two functions scripts import from it.

DeepSpeed-Chat's LoRA conversion finds a layer by its dotted name and swaps it for a LoRA layer.
"""

from functools import reduce


def recursive_getattr(model, module_name: str):
    """`model.a.b.c` for "a.b.c"."""
    return reduce(getattr, module_name.split("."), model)


def recursive_setattr(model, module_name: str, module) -> None:
    """Sets `model.a.b.c = module` for "a.b.c"."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)

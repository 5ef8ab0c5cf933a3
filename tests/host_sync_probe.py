"""A probe for host reads of tensors: what makes the host wait for the device in a step.

`HostReadProbe` is a `TorchFunctionMode` that records every call that turns a tensor into
Python values (`item`, `bool`, `float`, `int`, `tolist`, `numpy`), with the first frame of
zerotrain (or of the test) that made it. On a GPU each is a device synchronisation; on the CPU
the calls are the same, so a CPU test sees where a GPU run would wait.
"""

from __future__ import annotations

import sys

from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy"})


class HostReadProbe(TorchFunctionMode):
    """Counts host reads of tensors while active: `reads` lists (call, "file:function") pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append((name, _caller()))
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame outside torch: who asked for the value."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or __file__ == frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"

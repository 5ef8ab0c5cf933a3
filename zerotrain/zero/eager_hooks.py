"""eager_hook: ZeRO's hooks run eagerly, also inside a model the user compiles.

A whole-model `torch.compile` (or Accelerate's per-block `nn.Module.compile`) traces
module hooks along with the forward. ZeRO's gather / free / reduce hooks issue
collectives, swap `param.data` and keep Python bookkeeping: traced, they would break
the graph in odd places or be baked in. Wrapped in `torch.compiler.disable`, dynamo
breaks the graph at the hook and runs it as plain Python; outside compilation the wrapper
costs well under a microsecond a call. torch._dynamo (slow to import) is imported when
hooks are installed, not when zerotrain is; building a transformers model imports it anyway.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

Hook = TypeVar("Hook", bound=Callable)


def eager_hook(hook: Hook) -> Hook:
    """`hook`, never traced by torch.compile (dynamo runs it eagerly, as called)."""
    return torch.compiler.disable(hook, reason="zerotrain's ZeRO hooks run eagerly, outside compiled graphs")

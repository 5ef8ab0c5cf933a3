"""register_external_parameter: a parameter one module's forward uses but another module owns.

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(4))
            # the output projection is tied to the first layer's weight
            zerotrain.zero.register_external_parameter(self, self.layers[0].proj.weight)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x @ self.layers[0].proj.weight.T

At ZeRO stage 3 a unit's parameters are whole only while that unit computes, so a
parameter read by another unit's forward would be an empty tensor there. Registered on
the module that reads it, it is gathered with that module's unit before its forward and
backward (see `ParamGatherer`). As in DeepSpeed, the registration is kept on the module
(`module._external_params`, keyed by `id(parameter)`), so it may be made in `__init__`,
before `zerotrain.initialize`. Where parameters are never partitioned (stages 0-2) it has
no effect.
"""

from __future__ import annotations

from torch import nn

# Bumped by every (un)registration, so a ParamGatherer knows when to rebuild its map.
_generation = 0


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Marks `parameter` as used by `module`'s forward, as `deepspeed.zero.register_external_parameter`.

    Raises:
        RuntimeError: `parameter` is not an `nn.Parameter` (DeepSpeed's error).
    """
    global _generation
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    module._external_params[id(parameter)] = parameter
    _generation += 1


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undoes `register_external_parameter`, as DeepSpeed's.

    Raises:
        RuntimeError: `parameter` is not an `nn.Parameter`, or not registered on `module`.
    """
    global _generation
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    registry = getattr(module, "_external_params", None)
    if registry is None or id(parameter) not in registry:
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del registry[id(parameter)]
    _generation += 1


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered on `module` itself (not on its children)."""
    return list(getattr(module, "_external_params", {}).values())


def registration_generation() -> int:
    """A number that changes whenever any registration changes."""
    return _generation

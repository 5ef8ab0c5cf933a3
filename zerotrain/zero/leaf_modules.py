"""ZeRO-3 leaf modules: modules gathered whole, never split into smaller units.

DeepSpeed's `set_z3_leaf_modules` marks a module (a mixture-of-experts block, typically) so
that ZeRO-3 fetches all of its parameters when it starts instead of hooking its children:
experts run in an order that changes with the data, and an expert no token chose on a rank
is not run there, so per-expert gathers would differ from rank to rank. zerotrain gathers
whole units (`units.py`), so the flag means one thing here: no unit lies inside a leaf module.
The functions carry DeepSpeed's names and returns (the stand-in's `deepspeed.utils` re-exports
them); the flag is DeepSpeed's own attribute, `_z3_leaf`, so code reading it directly agrees.
"""

from __future__ import annotations

from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.config.zero_schema import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig, ZeroConfig

LEAF_FLAG = "_z3_leaf"
"""The attribute DeepSpeed sets on a leaf module (True) or clears (False)."""


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` (one module) is flagged as a ZeRO-3 leaf."""
    return bool(getattr(model, LEAF_FLAG, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) flagged as ZeRO-3 leaves, in `modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flags (or unflags) this one module as a ZeRO-3 leaf."""
    setattr(model, LEAF_FLAG, flag)


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flags every module of `model` of one of `leaf_module_classes` (a class, its name, or its
    module-qualified name) as a ZeRO-3 leaf: gathered whole, never split into units. Call it
    before the engine is built. Returns the modules flagged, children before parents (as
    DeepSpeed); ValueError if none matched, unless `raise_if_not_found=False`."""
    return _flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clears the flag `set_z3_leaf_modules` set; returns the modules matched."""
    return _flag(model, leaf_module_classes, False, raise_if_not_found)


def apply_leaf_module_config(model: nn.Module, zero: ZeroConfig) -> list[nn.Module]:
    """At ZeRO-3, flags the modules `zero.leaf_module` names as leaves, as DeepSpeed's engine does when
    it is built: of its classes (unset: DeepSpeed's default MoE blocks), its names (as named_modules()
    gives them) and its name suffixes. Returns the modules flagged (none below stage 3: no units there).
    ConfigError for a name or suffix that matches no module, and for classes of the user's own of
    which none is in the model: the section would silently do nothing."""
    if zero.stage != 3:
        return []
    section = zero.leaf_module or LeafModuleConfig()
    where = "zero_optimization.leaf_module"
    named = dict(model.named_modules())
    by_class = _flag(model, section.classes, True, raise_if_not_found=False)
    if section.classes and not by_class and section.classes != DEFAULT_LEAF_MODULE_CLASSES:
        raise ConfigError(f"{where}.classes: no module of {section.classes} in the model ({type(model).__name__}): "
                          "give the class of its mixture-of-experts block (e.g. MixtralSparseMoeBlock), or remove it")
    missing = [n for n in section.names if n not in named]
    unmatched = [s for s in section.name_suffixes if not any(n.endswith(s) for n in named)]
    if missing or unmatched:
        key, wrong = ("names", missing) if missing else ("name_suffixes", unmatched)
        example = max(named, key=lambda n: n.count("."))
        raise ConfigError(f"{where}.{key}: {wrong} match no module of the model ({type(model).__name__}): give names "
                          f"as model.named_modules() has them (e.g. {example!r}), or remove them")
    chosen = {id(m): m for m in by_class}
    chosen.update((id(named[n]), named[n]) for n in section.names)
    chosen.update((id(m), m) for s in section.name_suffixes for n, m in named.items() if n.endswith(s))
    for module in chosen.values():
        set_z3_leaf_module(module, True)
    return list(chosen.values())


def within_leaf_modules(model: nn.Module) -> set[int]:
    """Ids of the leaf modules of `model` and of every module inside one: none of them holds units."""
    within: set[int] = set()
    for leaf in get_z3_leaf_modules(model):
        within.update(id(m) for m in leaf.modules())
    return within


def _flag(model: nn.Module, classes: list[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if isinstance(classes, (type, str)) or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(
            f"leaf module classes must be a list of classes or class names, got {classes!r}: "
            "pass e.g. [MixtralSparseMoeBlock] or ['MixtralSparseMoeBlock']"
        )
    matched: list[nn.Module] = []

    def mark(module: nn.Module) -> None:
        if any(_is_of_class(module, wanted) for wanted in classes):
            setattr(module, LEAF_FLAG, flag)
            matched.append(module)

    model.apply(mark)  # children before their parent: the order DeepSpeed returns them in
    if not matched and raise_if_not_found:
        names = [c.__name__ if isinstance(c, type) else c for c in classes]
        raise ValueError(
            f"no module of class {names} found in the model ({type(model).__name__}): pass the class of "
            "the model's mixture-of-experts block (e.g. MixtralSparseMoeBlock), or raise_if_not_found=False"
        )
    return matched


def _is_of_class(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")

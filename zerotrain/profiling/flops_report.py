"""The FLOPs profile as text, in DeepSpeed's layout: summary, top modules per depth, module tree."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from zerotrain.profiling.step_flops import StepFlops

_LINE = "{:<70}  {}"


@dataclass
class StepTimes:
    """Seconds of the profiled micro-step's phases, and the figures the summary needs."""

    forward: float
    backward: float
    step: float
    world_size: int
    micro_batch: int
    peak_flops: float | None  # the device's peak FLOPS for the dtype, None if unknown


def _num(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}".rstrip()


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_profile(flops: StepFlops, times: StepTimes, profile_step: int, module_depth: int = -1,
                   top_modules: int = 1, detailed: bool = True) -> str:
    """The report for one profiled micro-step on this rank."""
    model = flops.model
    root = flops.names[model]
    params = flops.params(model)
    fwd = flops.total("forward")
    bwd = flops.total("backward")
    lines = [
        "",
        "-------------------------- zerotrain FLOPs profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "Notations: data parallel size (dp_size), model parallel size (mp_size), number of parameters (params),",
        "multiply-accumulate operations (MACs), floating-point operations (flops), flops per second (FLOPS),",
        "fwd/bwd latency (forward/backward propagation), step (weights update), iter latency (their sum)",
        "",
        _LINE.format("world size: ", times.world_size),
        _LINE.format("data parallel size: ", times.world_size),
        _LINE.format("model parallel size: ", 1),
        _LINE.format("batch size per GPU: ", times.micro_batch),
        _LINE.format("params per GPU: ", _num(params)),
        _LINE.format("params of model = params per GPU * mp_size: ", _num(params)),
        _LINE.format("fwd MACs per GPU: ", _num(fwd / 2, "MACs")),
        _LINE.format("fwd flops per GPU: ", _num(fwd)),
        _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", _num(fwd)),
        _LINE.format("fwd latency: ", _duration(times.forward)),
        _LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _num(fwd / times.forward, "FLOPS")),
        _LINE.format("bwd latency: ", _duration(times.backward)),
        _LINE.format("bwd FLOPS per GPU = bwd flops per GPU / bwd latency: ", _num(bwd / times.backward, "FLOPS")),
        _LINE.format("fwd+bwd FLOPS per GPU = model flops per GPU / (fwd+bwd latency): ",
                     _num(flops.model_flops / (times.forward + times.backward), "FLOPS")),
        _LINE.format("step latency: ", _duration(times.step)),
    ]
    iteration = times.forward + times.backward + times.step
    achieved = flops.model_flops / iteration
    lines += [
        _LINE.format("iter latency: ", _duration(iteration)),
        _LINE.format("FLOPS per GPU = model flops per GPU / iter latency: ", _num(achieved, "FLOPS")),
        _LINE.format("samples/second: ", f"{times.micro_batch * times.world_size / iteration:.2f}"),
        _LINE.format("model flops per GPU (fwd + bwd): ", _num(flops.model_flops)),
        _LINE.format("hardware flops per GPU (fwd + bwd + recomputed fwd): ", _num(flops.hardware_flops)),
        _LINE.format("MFU (model FLOPS / device peak): ",
                     f"{100 * achieved / times.peak_flops:.1f}%" if times.peak_flops else "n/a (no known peak)"),
    ]
    if flops.analytic_modules:
        layers = sorted(n for n in flops.analytic_modules if n != "Global" and not _has_child(n, flops.analytic_modules))
        lines.append("Attention FLOPs added analytically (4.b.s^2.h forward; a kernel the counter cannot see) in: "
                     + ", ".join(_short(n, root) for n in layers))
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += _aggregated(flops, module_depth, top_modules)
    if detailed:
        lines += [
            "", "------------------------------ Detailed Profile per GPU ------------------------------",
            "Each module profile is listed after its name in the following order:",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            "",
        ]
        lines += _tree(flops, model, "", 0, module_depth)
    return "\n".join(lines) + "\n"


def _has_child(name: str, names: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in names)


def _short(name: str, root: str) -> str:
    return name[len(root) + 1:] if name.startswith(root + ".") else name


def _depth_of(name: str, root: str) -> int:
    return 0 if name == root else _short(name, root).count(".") + 1


def _aggregated(flops: StepFlops, module_depth: int, top: int) -> list[str]:
    root = flops.names[flops.model]
    by_depth: dict[int, list[tuple[nn.Module, str]]] = {}
    for module, name in flops.names.items():
        by_depth.setdefault(_depth_of(name, root), []).append((module, name))
    lines = [f"Top {top} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in sorted(by_depth):
        if module_depth != -1 and depth > module_depth:
            break
        # DeepSpeed groups a depth's modules by class: the 2 decoder layers count as one entry.
        params: dict[str, int] = {}
        macs: dict[str, float] = {}
        latency: dict[str, float] = {}
        for module, name in by_depth[depth]:
            kind = type(module).__name__
            params[kind] = params.get(kind, 0) + flops.params(module)
            macs[kind] = macs.get(kind, 0) + flops.module_flops(name, "forward") / 2
            latency[kind] = latency.get(kind, 0) + flops.latency.get(name, 0.0)

        def top_of(values: dict, fmt) -> str:
            best = sorted(values.items(), key=lambda kv: -kv[1])[:top]
            return "{" + ", ".join(f"'{k}': '{fmt(v)}'" for k, v in best) + "}"

        lines += [f"depth {depth}:",
                  f"    params      - {top_of(params, _num)}",
                  f"    MACs        - {top_of(macs, lambda v: _num(v, 'MACs'))}",
                  f"    fwd latency - {top_of(latency, _duration)}"]
    return lines


def _tree(flops: StepFlops, module: nn.Module, label: str, depth: int, module_depth: int) -> list[str]:
    name = flops.names[module]
    total_params = flops.params(flops.model) or 1
    total_macs = flops.total("forward") / 2 or 1
    total_latency = flops.latency.get(flops.names[flops.model], 0.0) or 1.0
    p, macs, lat = flops.params(module), flops.module_flops(name, "forward") / 2, flops.latency.get(name, 0.0)
    stats = (f"{_num(p)} = {100 * p / total_params:.2f}% Params, {_num(macs, 'MACs')} = {100 * macs / total_macs:.2f}% "
             f"MACs, {_duration(lat)} = {100 * lat / total_latency:.2f}% latency, "
             f"{_num(2 * macs / lat if lat else 0, 'FLOPS')}")
    pad = "  " * depth
    head = f"{pad}{label}{type(module).__name__}("
    children = list(module.named_children())
    if not children or (module_depth != -1 and depth >= module_depth):
        return [f"{head}{stats})"]
    lines = [head, f"{pad}  {stats}"]
    for child_name, child in children:
        lines += _tree(flops, child, f"({child_name}): ", depth + 1, module_depth)
    lines.append(f"{pad})")
    return lines

"""The measurements behind `zerotrain bench compute`: the FLOP formulas, a timer, and the four probes.

- matmul: a transformer layer's GEMMs (qkv, o, gate/up, down), each forward and its two backward
  GEMMs (grad input, grad weight), laid out as nn.Linear lays them (weight [out, in]).
- attention: causal SDPA forward + backward, counted as step_flops counts it: QK^T and AV over the
  full s x s square (4.b.n.s.s.d forward, twice that backward), causal or not.
- Adam: AdamW steps over one flat fp32 tensor (ZeRO's flat master shard), built as the engine builds it
  for a master on that device (zerotrain/optim/optimizers.py: fused on the CPU, foreach on a GPU).
- copies: pinned host <-> device copies of one 256 MiB buffer (GB/s = 1e9 bytes/s), and copies on the
  device into an existing and into a newly allocated buffer (the engine's gradient-buffer traffic).
- the model's own layer and head (with MODEL): a one-layer copy of the model on the device, its decoder
  layer called with the arguments the model gives it, and its final norm + LM head + loss.

Every time is the median of `iters` repeats after `warmup` untimed ones: CUDA events on a GPU
(recorded back to back, read after one synchronize), time.perf_counter on the CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_BYTES = 256 << 20
PHASES = ("forward", "grad input", "grad weight")


@dataclass(frozen=True)
class Shapes:
    """The layer the probe is shaped like; attention runs on (batch, heads, seq_len, head_dim)."""

    hidden: int
    intermediate: int
    tokens: int
    heads: int
    head_dim: int
    batch: int
    seq_len: int

    def as_dict(self) -> dict[str, int]:
        """The JSON's "shapes" (batch and seq_len are shown on the console only)."""
        return {"hidden": self.hidden, "intermediate": self.intermediate, "tokens": self.tokens,
                "heads": self.heads, "head_dim": self.head_dim}


def matmul_flops(m: int, n: int, k: int) -> int:
    """An (m x k) @ (k x n) GEMM: one multiply and one add per output element per k."""
    return 2 * m * n * k


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of attention: QK^T and AV, 2.b.n.s.s.d each over the full square
    (as zerotrain.profiling.step_flops counts SDPA), and twice the forward backward."""
    forward = 2 * (2 * batch * heads * seq_len * seq_len * head_dim)
    return forward, 2 * forward


def layer_linears(shapes: Shapes) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of a layer's linears: qkv fused, o, gate/up fused, down."""
    h, i = shapes.hidden, shapes.intermediate
    return [("qkv", h, 3 * h), ("o", h, h), ("gate/up", h, 2 * i), ("down", i, h)]


def matmul_shapes(shapes: Shapes) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of every GEMM timed: per linear, forward y = x W^T, grad input dx = dy W,
    grad weight dW = dy^T x."""
    t = shapes.tokens
    out = []
    for name, fan_in, fan_out in layer_linears(shapes):
        out += [(f"{name} forward", t, fan_out, fan_in), (f"{name} grad input", t, fan_in, fan_out),
                (f"{name} grad weight", fan_out, fan_in, t)]
    return out


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """The median time of `fn()` over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
    times = []
    for _ in range(iters):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _randn(*size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*size, dtype=torch.float32, device=device).to(dtype)


def measure_matmuls(shapes: Shapes, dtype: torch.dtype, device: torch.device, warmup: int, iters: int,
                    progress: Callable[[str], None] = lambda name: None) -> list[dict]:
    """One row per GEMM of matmul_shapes: name, m, n, k, seconds, tflops."""
    rows = []
    t = shapes.tokens
    for name, fan_in, fan_out in layer_linears(shapes):
        x = _randn(t, fan_in, dtype=dtype, device=device)
        weight = _randn(fan_out, fan_in, dtype=dtype, device=device)
        grad_y = _randn(t, fan_out, dtype=dtype, device=device)
        gemms = {"forward": (x, weight.t(), (t, fan_out, fan_in)),
                 "grad input": (grad_y, weight, (t, fan_in, fan_out)),
                 "grad weight": (grad_y.t(), x, (fan_out, fan_in, t))}
        for phase in PHASES:
            a, b, (m, n, k) = gemms[phase]
            progress(f"matmul {name} {phase}")
            out = torch.empty(m, n, dtype=dtype, device=device)
            seconds = median_seconds(lambda: torch.matmul(a, b, out=out), device, warmup, iters)
            rows.append({"name": f"{name} {phase}", "m": m, "n": n, "k": k, "seconds": seconds,
                         "tflops": matmul_flops(m, n, k) / seconds / 1e12})
            del out
        del x, weight, grad_y
    return rows


def overall_tflops(rows: list[dict]) -> float:
    """FLOP-weighted rate of the rows: their total FLOPs over their total time."""
    return sum(matmul_flops(r["m"], r["n"], r["k"]) for r in rows) / sum(r["seconds"] for r in rows) / 1e12


def measure_attention(shapes: Shapes, dtype: torch.dtype, device: torch.device, warmup: int, iters: int) -> float:
    """TFLOP/s of causal SDPA forward + backward on (batch, heads, seq_len, head_dim)."""
    size = (shapes.batch, shapes.heads, shapes.seq_len, shapes.head_dim)
    q, k, v = (_randn(*size, dtype=dtype, device=device).requires_grad_() for _ in range(3))
    grad_out = _randn(*size, dtype=dtype, device=device)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    seconds = median_seconds(step, device, warmup, iters)
    return sum(attention_flops(*size)) / seconds / 1e12


def _adam(param: torch.Tensor) -> tuple[torch.optim.Optimizer, str]:
    """AdamW over `param` as the engine builds it for a master on this device (zerotrain.optim: fused
    CPU Adam for CPU masters, foreach on a GPU), and which kernel that is. Timing torch's fastest kernel
    instead predicted the GPU step at a quarter of what the engine took (H100, 2026-11-27)."""
    from zerotrain.optim import build_optimizer

    optimizer = build_optimizer("AdamW", {"lr": 1e-4}, [param])
    group = optimizer.param_groups[0]
    impl = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    optimizer.step()  # state allocated before the timing
    return optimizer, impl


def measure_adam(elements: int, device: torch.device, warmup: int, iters: int) -> tuple[float, str]:
    """(elements per second, implementation) of Adam steps over one flat fp32 parameter."""
    param = torch.nn.Parameter(torch.zeros(elements, dtype=torch.float32, device=device))
    param.grad = torch.randn(elements, dtype=torch.float32, device=device) * 1e-3
    optimizer, impl = _adam(param)
    seconds = median_seconds(optimizer.step, device, warmup, iters)
    return elements / seconds, impl


def measure_device_copy(device: torch.device, size: int, warmup: int, iters: int) -> tuple[float, float]:
    """(into an existing buffer, into a new one) GB/s of copying `size` bytes on the device, as the engine
    copies gradients into its flat buffers: GB/s = bytes copied / time (each read once and written once).
    A new buffer is allocated for every copy and dropped after it: on the CPU a buffer this large comes
    from the OS every time (its pages are faulted in as they are written); a GPU's caching allocator
    reuses the block."""
    elements = max(1, size // 4)
    src = torch.randn(elements, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    into = median_seconds(lambda: dst.copy_(src), device, warmup, iters)
    del dst
    fresh = median_seconds(lambda: torch.empty_like(src).copy_(src), device, warmup, iters)
    return elements * 4 / into / 1e9, elements * 4 / fresh / 1e9


def measure_copies(device: torch.device, warmup: int, iters: int, size: int = COPY_BYTES) -> tuple[float, float]:
    """(host to device, device to host) GB/s of pinned copies of `size` bytes."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    to_device = median_seconds(lambda: on_device.copy_(host, non_blocking=True), device, warmup, iters)
    to_host = median_seconds(lambda: host.copy_(on_device, non_blocking=True), device, warmup, iters)
    return size / to_device / 1e9, size / to_host / 1e9


# --- the model's own layer and head -------------------------------------------------------------

_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def _layer_list_name(meta_model: torch.nn.Module) -> str | None:
    """The qualified name of the ModuleList holding the decoder layers (zero.units' choice), if any."""
    from zerotrain.zero.units import find_layer_units

    units = find_layer_units(meta_model)
    if not units:
        return None
    for name, module in meta_model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and module[0] is units[0]:
            return name
    return None


def one_layer_model(meta_model: torch.nn.Module, dtype: torch.dtype, device: torch.device):
    """(the same causal LM with one decoder layer, built on `device` in `dtype`, that layer), or None
    for a model whose layer count or layer list is not found (the layer rates are then left out)."""
    import copy

    name = _layer_list_name(meta_model)
    config = copy.deepcopy(meta_model.config)
    keys = [key for key in _LAYER_COUNT_KEYS if isinstance(getattr(config, key, None), int)]
    if name is None or not keys:
        return None
    for key in keys:
        setattr(config, key, 1)
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer kinds (sliding, full, ...)
        config.layer_types = config.layer_types[:1]
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a cache would grow with every timed call
    with torch.device(device):
        model = type(meta_model)(config)
    model = model.to(dtype).train()
    layers = model.get_submodule(name)
    return (model, layers[0]) if len(layers) == 1 else None


def _grads_to_none(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def measure_layer(model: torch.nn.Module, layer: torch.nn.Module, batch: int, seq_len: int, device: torch.device,
                  warmup: int, iters: int) -> float:
    """Seconds of one decoder layer's forward + backward on (batch, seq_len) tokens, called with the
    arguments the model itself gives it (rotary embeddings, mask), captured on one forward."""
    captured: dict = {}

    def capture(_module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
    ids = torch.randint(0, int(model.config.vocab_size), (batch, seq_len), device=device)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    args, kwargs = captured["call"]

    def detached(value):
        return value.detach() if isinstance(value, torch.Tensor) else (
            tuple(detached(v) for v in value) if isinstance(value, tuple) else value)

    hidden = args[0] if args else kwargs.pop("hidden_states")
    rest = tuple(detached(a) for a in args[1:])
    kwargs = {k: detached(v) for k, v in kwargs.items()}
    x = hidden.detach().clone().requires_grad_()
    grad_out = torch.randn_like(x) * 1e-3

    def step():
        _grads_to_none(layer)
        x.grad = None
        out = layer(x, *rest, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.backward(grad_out)

    return median_seconds(step, device, warmup, iters)


def measure_head(model: torch.nn.Module, batch: int, seq_len: int, device: torch.device, warmup: int,
                 iters: int) -> float | None:
    """Seconds of the final norm, the LM head and the loss (the model's own loss function) forward +
    backward on hidden states of (batch, seq_len); None when the head or the final norm is not found."""
    head = model.get_output_embeddings()
    base = getattr(model, "base_model", model)
    norm = next((getattr(base, n) for n in _FINAL_NORMS if isinstance(getattr(base, n, None), torch.nn.Module)),
                None)
    if head is None or norm is None:
        return None
    vocab = int(model.config.vocab_size)
    dtype = head.weight.dtype
    x = _randn(batch, seq_len, head.in_features, dtype=dtype, device=device).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq_len), device=device)
    loss_function = getattr(model, "loss_function", None)

    def loss_of(logits):
        if loss_function is not None:
            return loss_function(logits, labels, vocab)
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1))

    def step():
        _grads_to_none(model)
        x.grad = None
        loss_of(head(norm(x))).backward()

    return median_seconds(step, device, warmup, iters)

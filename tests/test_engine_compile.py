"""`engine.compile(...)` as Accelerate and the HF Trainer call it, DeepSpeed's `compile` section and
`training.compile`, on a world of one in this process (backend "eager": dynamo's capture, no C++ builds)."""

from __future__ import annotations

import logging

import pytest
import torch

import zerotrain
from zerotrain.config import ConfigError
from llama_workload import global_batch, make_model, param_groups, zero_config


def _engine(**config_extra):
    model = make_model()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model),
                                      config={**zero_config(1, 1, 1), "train_batch_size": 4, **config_extra})
    return engine


def _losses(engine, steps: int = 3) -> list[float]:
    out = []
    for step in range(steps):
        ids = global_batch(step)[:4]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


class _Said(logging.Handler):
    """What the "zerotrain" logger says (it may not propagate to the root, where caplog listens)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def said():
    handler, logger = _Said(), logging.getLogger("zerotrain")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(previous)


def _is_compiled_fn(fn) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable")  # what torch.compile returns


def test_engine_compile_as_accelerate_calls_it_compiles_each_layer_and_the_loss_and_trains_as_eager(said):
    eager = _losses(_engine())
    engine = _engine()
    assert engine.is_compiled is False
    engine.compile(backend="eager", compile_kwargs={"dynamic": False})  # accelerator.py's call
    assert engine.is_compiled is True
    layers = engine.module.model.layers
    assert all(_is_compiled_fn(vars(layer)["forward"]) for layer in layers)
    assert not _is_compiled_fn(engine.module.forward), "the root's forward (its hooks' callers) stays eager"
    assert engine.module._compiled_call_impl is None and layers[0]._compiled_call_impl is None  # hooks outside
    assert _is_compiled_fn(engine.module.loss_function)
    compiled = _losses(engine)
    assert sum("compiled in" in m for m in said) == 1, f"compile time is said once: {said}"
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-6, atol=1e-6)


def test_a_second_compile_changes_nothing_and_says_so_when_its_arguments_differ(said):
    engine = _engine()
    engine.compile(backend="eager")
    forward = vars(engine.module.model.layers[0])["forward"]
    engine.compile(backend="eager")
    assert not said
    engine.compile(backend="aot_eager")
    assert len(said) == 1 and "changes nothing" in said[0]
    assert vars(engine.module.model.layers[0])["forward"] is forward


def test_compile_refuses_what_it_cannot_do_and_names_the_argument():
    engine = _engine()
    with pytest.raises(ValueError, match="DeepCompile"):
        engine.compile(schedule=[(0, ["z3"])])
    with pytest.raises(ValueError, match="compiled autograd"):
        engine.compile(compiled_autograd_enabled=True)
    with pytest.raises(TypeError, match=r"\['nonsense'\] are not torch.compile arguments"):
        engine.compile(backend="eager", compile_kwargs={"nonsense": 1})
    assert engine.is_compiled is False


def test_deepspeed_compile_section_compiles_at_initialize_and_refuses_deepcompile():
    engine = _engine(compile={"enabled": True, "backend": "eager", "kwargs": {"dynamic": False},
                              "free_activation": False})  # a DeepCompile option, switched off: accepted
    assert engine.is_compiled and _is_compiled_fn(vars(engine.module.model.layers[0])["forward"])
    assert _engine(compile={"deepcompile": False}).is_compiled is False
    with pytest.raises(ConfigError, match="compile.deepcompile = true: DeepCompile"):
        _engine(compile={"deepcompile": True})
    with pytest.raises(ConfigError, match="compile.backend"):
        _engine(compile={"enabled": True, "kwargs": {"backend": "eager"}})


def test_training_compile_switches_on_the_deepspeed_compile_section():
    from zerotrain.train.config import validate_train_config

    cfg = validate_train_config({"model": {"architecture": "llama"}, "training": {"compile": True},
                                 "zero": {"compile": {"backend": "aot_eager"}}})
    assert cfg.zero_dict()["compile"] == {"backend": "aot_eager", "enabled": True}
    assert "compile" not in validate_train_config({"model": {"architecture": "llama"}}).zero_dict()

"""The names transformers and Accelerate import from `deepspeed` are zerotrain's objects.

The list is read from transformers' integrations/deepspeed.py, trainer.py and modeling_utils.py
and Accelerate's accelerator.py, state.py, utils/deepspeed.py, utils/other.py and commands/launch.py.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import zerotrain
from zerotrain.runtime.engine import Engine


def test_the_standin_hands_out_zerotrains_own_objects(standin_deepspeed):
    ds = standin_deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert ds.DeepSpeedEngine is DeepSpeedEngine is Engine
    assert ds.initialize is zerotrain.initialize
    assert ds.zero.Init is zerotrain.zero.Init and ds.zero.GatheredParameters is zerotrain.zero.GatheredParameters
    assert importlib.metadata.version("deepspeed") == ds.__version__


def test_every_name_transformers_and_accelerate_import_is_there(standin_deepspeed):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.comm import get_rank, init_distributed, is_initialized
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.utils import logger
    from deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    assert callable(init_distributed) and is_initialized() in (True, False) and get_rank() == 0
    assert get_accelerator().current_device_name() == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"} <= set(VALID_LR_SCHEDULES)
    assert pp._orig_torch_arange is torch.arange and callable(pp.zero_wrapper_for_fp_tensor_constructor)
    assert logger.name == "zerotrain"
    assert all(issubclass(c, torch.optim.Optimizer) for c in (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion))
    assert all(map(callable, (clone_tensors_for_torch_save, convert_zero_checkpoint_to_fp32_state_dict,
                              get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint)))


def test_clone_tensors_for_torch_save_copies_views_into_their_own_storage(standin_deepspeed):
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(10.0)
    state = {"a": flat[:4].view(2, 2), "nested": [flat[4:]], "step": 3}
    copied = clone_tensors_for_torch_save(state)
    assert torch.equal(copied["a"], state["a"]) and copied["step"] == 3
    assert copied["a"].untyped_storage().nbytes() == 4 * 4  # not the whole flat buffer
    assert copied["nested"][0].data_ptr() != flat[4:].data_ptr()


def test_zero_init_accepts_a_config_that_still_holds_auto(standin_deepspeed):
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    with standin_deepspeed.zero.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.is_meta  # deferred until initialize shards it


def test_what_zerotrain_lacks_is_refused_by_name(standin_deepspeed):
    with pytest.raises(NotImplementedError, match="Tensor parallelism .* not supported by zerotrain"):
        standin_deepspeed.tp_model_init(model=None, tp_size=2, dtype=torch.float32)


def test_accelerate_opens_ulysses_and_autotp_paths_and_the_ulysses_names_are_there(standin_deepspeed):
    import inspect

    from accelerate.utils import compare_versions

    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, sequence_tiled_compute,
    )
    from deepspeed.utils import groups

    # Accelerate asks for deepspeed >= 0.18.2 before Ulysses (and >= 0.16.4 before AutoTP, which zerotrain
    # refuses itself: tests/hf/test_ulysses_clients.py)
    assert compare_versions("deepspeed", ">=", "0.18.2") and compare_versions("deepspeed", ">=", "0.16.4")
    assert standin_deepspeed.__version__ == "0.19.8"
    # Accelerate passes disable_in_eval only when the signature has it
    assert list(inspect.signature(UlyssesSPAttentionHF.register_with_transformers).parameters) == [
        "model_name_or_path", "core_attn_implementation", "sequence_parallel_size", "micro_batch_size",
        "seq_length", "seq_length_is_variable", "disable_in_eval", "max_length"]
    assert UlyssesSPAttentionHF.register_with_transformers("unused", "sdpa", 1, 1) is None  # sp 1: nothing done
    assert groups._get_sequence_parallel_world_size.__module__ == "deepspeed.utils.groups"
    assert callable(TiledMLP.apply) and callable(TiledFusedLogitsLoss.apply) and callable(sequence_tiled_compute)
    assert UlyssesSPDataLoaderAdapter.__len__


def test_the_names_deepspeed_chat_imports_are_there(standin_deepspeed):
    """DeepSpeed-Chat's three steps import these before training (and stopped there on zerotrain)."""
    from torch import nn

    from deepspeed import get_accelerator
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert get_accelerator().device_name() in ("cpu", "cuda") and ZeroParamStatus.NOT_AVAILABLE.value == 2
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    recursive_setattr(model, "0.0", nn.Identity())
    assert isinstance(model[0][0], nn.Identity)
    assert issubclass(FusedAdam, DeepSpeedCPUAdam)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_given_to_initialize_steps_as_torch_adam(standin_deepspeed, adam_w_mode):
    from torch import nn

    from deepspeed.ops.adam import FusedAdam

    def run(make_optimizer):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = make_optimizer(model.parameters())
        engine = zerotrain.initialize(model=model, optimizer=optimizer,
                                      config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})[0]
        for step in range(3):
            x = torch.full((2, 4), float(step + 1))
            engine.backward(engine(x).square().mean())
            engine.step()
        return model.weight.detach().clone()

    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    fused = run(lambda p: FusedAdam(p, lr=0.1, weight_decay=0.1, adam_w_mode=adam_w_mode))
    reference = run(lambda p: torch_cls(p, lr=0.1, weight_decay=0.1))
    assert torch.allclose(fused, reference, atol=1e-6)


def test_activation_checkpointing_configure_takes_defaults_and_refuses_what_zerotrain_lacks(standin_deepspeed):
    import deepspeed

    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)  # Lightning's defaults
    with pytest.raises(NotImplementedError, match="partition_activations=True"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    from deepspeed.utils.logging import logger

    assert logger.name == "zerotrain"


def test_the_aio_section_lightning_writes_is_accepted():
    from zerotrain.config import check_supported, load_config

    aio = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True, "thread_count": 1}
    check_supported(load_config({"train_micro_batch_size_per_gpu": 1, "aio": aio}))

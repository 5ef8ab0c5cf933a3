"""Every public name stays where users import it from, whatever the folders inside look like.

Two faces: zerotrain's own (`import zerotrain`, `zerotrain.zero`, ...; `import zerotrain as
deepspeed`), and the `deepspeed` stand-in that scripts, the HF Trainer, Accelerate and TRL import
unchanged. A name moved or dropped here breaks someone's script: change this list only on purpose.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from conftest import user_env

ZEROTRAIN_NAMES = {
    "zerotrain": ["initialize", "init_distributed", "add_config_arguments", "zero", "__version__"],
    "zerotrain.zero": ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter"],
    "zerotrain.checkpoint": ["CheckpointError", "CheckpointReader", "consolidate", "export_hf",
                             "load_consolidated_state_dict"],
    "zerotrain.config": ["ConfigError", "ZeroTrainConfig", "check_supported", "load_config", "resolve_batch_sizes",
                         "resolve_config"],
    "zerotrain.optim": ["SCHEDULES", "SUPPORTED_OPTIMIZERS", "DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam",
                        "DeepSpeedCPULion", "LRRangeTest", "Lamb", "Lion", "OneCycle", "WarmupCosineLR",
                        "WarmupDecayLR", "WarmupLR", "build_optimizer", "build_scheduler"],
    "zerotrain.runtime.engine": ["Engine"],
    "zerotrain.cli.main": ["main", "build_parser"],
}

STANDIN_NAMES = {
    "deepspeed": ["DeepSpeedEngine", "__version__", "add_config_arguments", "init_distributed", "initialize",
                  "zero", "comm", "accelerator", "runtime", "utils", "checkpoint", "launcher"],
    "deepspeed.accelerator": ["get_accelerator"],
    "deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "deepspeed.comm": ["get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_initialized"],
    "deepspeed.launcher.runner": ["DEEPSPEED_ENVIRONMENT_NAME", "main"],
    "deepspeed.ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "deepspeed.ops.adam": ["DeepSpeedCPUAdam"],
    "deepspeed.ops.lion": ["DeepSpeedCPULion"],
    "deepspeed.runtime.engine": ["DeepSpeedEngine"],
    "deepspeed.runtime.lr_schedules": ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR",
                                       "WarmupDecayLR", "WarmupLR"],
    "deepspeed.runtime.zero": ["GatheredParameters", "Init", "register_external_parameter"],
    "deepspeed.runtime.zero.partition_parameters": ["GatheredParameters", "Init"],
    "deepspeed.runtime.zero.stage3": ["estimate_zero3_model_states_mem_needs_all_cold",
                                      "estimate_zero3_model_states_mem_needs_all_live"],
    "deepspeed.runtime.zero.stage_1_and_2": ["estimate_zero2_model_states_mem_needs_all_cold",
                                             "estimate_zero2_model_states_mem_needs_all_live"],
    "deepspeed.utils": ["logger", "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
                        "z3_leaf_module", "set_z3_leaf_module"],
    "deepspeed.utils.zero_to_fp32": ["convert_zero_checkpoint_to_fp32_state_dict",
                                     "get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint"],
    "deepspeed.zero": ["Init", "GatheredParameters"],
}


@pytest.mark.parametrize("module", sorted(ZEROTRAIN_NAMES))
def test_zerotrain_names_import_from_where_users_import_them(module):
    imported = importlib.import_module(module)
    missing = [name for name in ZEROTRAIN_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"


def test_import_zerotrain_as_deepspeed_gives_deepspeeds_entry_points():
    import zerotrain as deepspeed

    assert set(ZEROTRAIN_NAMES["zerotrain"]) <= set(deepspeed.__all__)
    assert deepspeed.zero.Init is importlib.import_module("zerotrain.zero").Init
    assert callable(deepspeed.initialize) and callable(deepspeed.init_distributed)


@pytest.mark.slow
def test_the_standin_names_import_in_a_fresh_process_with_the_standin_on_the_path():
    """In a process of its own, as a job gets the stand-in (its own `deepspeed` must not leak here)."""
    from zerotrain.compat.deepspeed_standin import with_standin

    script = (
        "import importlib, json, sys\n"
        f"names = {STANDIN_NAMES!r}\n"
        "missing = {m: [n for n in ns if not hasattr(importlib.import_module(m), n)] for m, ns in names.items()}\n"
        "print(json.dumps({m: v for m, v in missing.items() if v}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=with_standin(user_env()), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "{}", f"names the stand-in lost: {done.stdout}"

"""A checkpoint carries training state, not how the saving machine ran its optimizer.

Found on an H100 (2026-11-27): a checkpoint saved by CPU ranks (whose masters take torch's fused
CPU Adam) loaded on a GPU turned on CUDA's fused kernel with the `step` counters left on the CPU,
and the first step failed. The same happens on one machine when the two runs pick different
kernels, which is what this test does on the CPU.
"""

from __future__ import annotations

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config


def _train(config: dict, steps: int, load_dir: str | None, save_dir: str | None) -> dict:
    import zerotrain

    model = make_model(seed=0)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    if load_dir:
        engine.load_checkpoint(load_dir)
    kernels = [(g.get("fused"), g.get("foreach")) for g in engine.optimizer.optimizer.param_groups]
    for step in range(steps):
        ids = global_batch(step)[: engine.train_micro_batch_size_per_gpu()]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    if save_dir:
        engine.save_checkpoint(save_dir)
    return {"kernels": kernels, "steps": engine.global_steps}


def test_loading_keeps_this_engines_optimizer_kernel(tmp_path):
    fused = zero_config(2, 1, 1)  # CPU masters: the engine picks torch's fused CPU Adam
    foreach = zero_config(2, 1, 1)
    foreach["optimizer"]["params"]["foreach"] = True  # this run asks for another kernel
    saved = run_on_ranks(1, _train, fused, 2, None, str(tmp_path))[0]
    assert all(f for f, _ in saved["kernels"]), saved
    loaded = run_on_ranks(1, _train, foreach, 1, str(tmp_path), None)[0]
    assert loaded["steps"] == 3
    assert all(not f and e for f, e in loaded["kernels"]), f"the checkpoint's kernel choice was taken: {loaded}"

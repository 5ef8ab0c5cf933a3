"""Hugging Face's ZeRO-3 loading on zerotrain: `from_pretrained`, `from_config`,
`resize_token_embeddings` and `generate`, as a Trainer script runs them under DeepSpeed.

With a stage-3 `HfDeepSpeedConfig` alive, transformers builds the model inside
`deepspeed.zero.Init` (here zerotrain's: parameters are deferred, on the meta device) and
writes each module's checkpoint tensors on rank 0 inside
`deepspeed.zero.GatheredParameters(params, modifier_rank=0)`. Those writes must survive,
already partitioned (each rank keeps about 1/world of them), until `initialize` shards the
model; the weights it then trains from are the checkpoint's, bit for bit.

Every rank runs `zerotrain.compat.deepspeed_standin.activate_in_this_process()` first, so the
`import deepspeed` inside transformers gets zerotrain; the ranks are spawned (`spawn=True`), so
transformers is first imported after that, as in a user's script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

VOCAB, ADDED, PROMPT_LEN, NEW_TOKENS = 128, 8, 6, 5
DS_CONFIG = {
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
}


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager",
    )


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(7))


def _zero3_world() -> object:
    """Per rank: the stand-in, the process group, and a live stage-3 HfDeepSpeedConfig (keep it)."""
    from zerotrain.compat.deepspeed_standin import activate_in_this_process

    activate_in_this_process()  # before transformers' DeepSpeed integration imports `deepspeed`
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from zerotrain.comm.distributed import init_distributed

    init_distributed()
    return HfDeepSpeedConfig(dict(DS_CONFIG))


def _initialize_and_gather(model) -> tuple:
    import zerotrain
    from zerotrain.zero import GatheredParameters

    engine, *_ = zerotrain.initialize(model=model, config=dict(DS_CONFIG))
    with GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return engine, weights


def _load_pretrained_and_run(checkpoint: str) -> dict:
    from transformers import AutoModelForCausalLM

    from zerotrain.zero.deferred_values import stored_numel

    hf_config = _zero3_world()  # noqa: F841 - transformers holds it only by weak reference
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    params = list(model.parameters())
    loaded = {
        "all_meta": all(p.is_meta for p in params),
        "kept_numel": sum(stored_numel(p) for p in params),
        "numel": sum(p.numel() for p in params),
        "ds_numel": sum(p.ds_numel for p in params),
    }
    engine, weights = _initialize_and_gather(model)
    engine.module.eval()
    prompt = _prompt().to(engine.device)
    with torch.no_grad():
        logits = engine(input_ids=prompt).logits.cpu()
        generated = engine.module.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False).cpu()
    return {**loaded, "weights": weights, "logits": logits, "generated": generated}


def _load_pretrained_and_resize(checkpoint: str) -> dict:
    from transformers import AutoModelForCausalLM

    hf_config = _zero3_world()  # noqa: F841
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.resize_token_embeddings(VOCAB + ADDED)
    vocab_size = model.config.vocab_size
    _, weights = _initialize_and_gather(model)
    return {"vocab_size": vocab_size, "weights": weights}


def _from_config_seeded() -> dict:
    from transformers import AutoModelForCausalLM

    hf_config = _zero3_world()  # noqa: F841
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config())
    all_meta = all(p.is_meta for p in model.parameters())
    _, weights = _initialize_and_gather(model)
    return {"all_meta": all_meta, "weights": weights}


# --- references: the same model, plain torch, in the test process ----------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(_tiny_config()).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def plain(checkpoint):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def loaded_on_two_ranks(checkpoint) -> list[dict]:
    return run_on_ranks(2, _load_pretrained_and_run, str(checkpoint), spawn=True)


def _assert_weights_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


# --- from_pretrained --------------------------------------------------------------------------

def test_from_pretrained_under_zero3_keeps_only_a_slice_per_rank_until_initialize(loaded_on_two_ranks):
    for r in loaded_on_two_ranks:
        assert r["all_meta"]  # no rank holds a whole weight after loading
        assert r["ds_numel"] == r["numel"]  # what Trainer counts parameters with
        # each rank's slices: half the model, up to the padding of odd-sized parameters
        assert r["numel"] / 2 <= r["kept_numel"] <= r["numel"] / 2 + 64


def test_from_pretrained_under_zero3_trains_from_the_checkpoint_weights(loaded_on_two_ranks, plain):
    want = {n: p.detach() for n, p in plain.named_parameters()}
    for r in loaded_on_two_ranks:
        _assert_weights_equal(r["weights"], want)


def test_from_pretrained_under_zero3_forward_matches_the_plain_model(loaded_on_two_ranks, plain):
    with torch.no_grad():
        want = plain(input_ids=_prompt()).logits
    for r in loaded_on_two_ranks:
        torch.testing.assert_close(r["logits"], want, rtol=1e-5, atol=1e-5)


def test_generate_at_stage3_matches_the_plain_model(loaded_on_two_ranks, plain):
    with torch.no_grad():
        want = plain.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
    for r in loaded_on_two_ranks:
        assert r["generated"].shape == (2, PROMPT_LEN + NEW_TOKENS)
        assert torch.equal(r["generated"], want)


def test_from_pretrained_under_zero3_on_one_rank(checkpoint, plain):
    (r,) = run_on_ranks(1, _load_pretrained_and_run, str(checkpoint), spawn=True)
    assert r["all_meta"] and r["kept_numel"] == r["numel"]  # one rank: its slice is the whole
    _assert_weights_equal(r["weights"], {n: p.detach() for n, p in plain.named_parameters()})
    with torch.no_grad():
        torch.testing.assert_close(r["logits"], plain(input_ids=_prompt()).logits, rtol=1e-5, atol=1e-5)


# --- from_config and resize_token_embeddings --------------------------------------------------

def test_from_config_under_zero3_gives_rank0s_seeded_initialization_on_every_rank():
    """Under ZeRO-3 transformers builds the model with its initializers switched off
    (`no_init_weights`), then rank 0 runs `_init_weights` module by module
    (`initialize_weights_zero3`). From the same seed that is what a model built without
    initializers and then given `initialize_weights()` holds; DeepSpeed gives the same. It
    is not the weights of a plain `from_config`, whose constructors draw from the
    generator (nn.Linear's `reset_parameters`) before `_init_weights` runs."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(0)
    with no_init_weights():
        reference = LlamaForCausalLM(_tiny_config())
    reference.initialize_weights()
    want = {n: p.detach() for n, p in reference.named_parameters()}
    for r in run_on_ranks(2, _from_config_seeded, spawn=True):
        assert r["all_meta"]
        _assert_weights_equal(r["weights"], want)


def test_resize_token_embeddings_under_zero3_keeps_the_old_rows(checkpoint):
    from transformers import LlamaForCausalLM

    resized = LlamaForCausalLM.from_pretrained(checkpoint)
    resized.resize_token_embeddings(VOCAB + ADDED)
    for r in run_on_ranks(2, _load_pretrained_and_resize, str(checkpoint), spawn=True):
        assert r["vocab_size"] == VOCAB + ADDED
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            got, want = r["weights"][name], dict(resized.named_parameters())[name].detach()
            assert got.shape == want.shape == (VOCAB + ADDED, 64), name
            assert torch.equal(got[:VOCAB], want[:VOCAB]), name
        for name, value in resized.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                continue
            assert torch.equal(r["weights"][name], value.detach()), name


# --- GatheredParameters on deferred parameters, one process -----------------------------------

class _Scale(torch.nn.Module):
    """A module with no initializer: its parameter's value comes from __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))


def test_gathered_deferred_parameter_keeps_edits_only_with_a_modifier_rank():
    from zerotrain.zero import GatheredParameters, Init

    with Init():
        model = torch.nn.Linear(3, 2)
    weight = model.weight
    with GatheredParameters(weight):
        assert not weight.is_meta and torch.equal(weight, torch.zeros(2, 3))  # nothing written yet
        weight.data.fill_(5.0)
    assert weight.is_meta  # dropped: no modifier_rank
    with GatheredParameters([weight, model.bias, None], modifier_rank=0):
        assert torch.equal(weight, torch.zeros(2, 3))
        weight.data.copy_(torch.arange(6.0).view(2, 3))
    assert model.weight is weight and weight.is_meta and weight.ds_shape == (2, 3) and weight.ds_numel == 6
    with GatheredParameters(weight):
        assert torch.equal(weight, torch.arange(6.0).view(2, 3))


def test_gathered_deferred_parameter_reads_its_small_init_value_before_any_write():
    from zerotrain.zero import GatheredParameters, Init

    with Init():
        scale = _Scale()
    with GatheredParameters(scale.weight):
        assert torch.equal(scale.weight, torch.ones(4))


# --- LoRA added by PEFT after a ZeRO-3 from_pretrained (LLaMA-Factory's and Axolotl's path) ------

def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _load_pretrained_with_lora(checkpoint: str) -> dict:
    hf_config = _zero3_world()  # noqa: F841 - first: peft imports transformers' DeepSpeed integration
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    torch.manual_seed(1)
    model = get_peft_model(base, _lora_config())
    lost = [n for n, p in model.named_parameters() if "lora_" in n and p.is_meta]
    _, weights = _initialize_and_gather(model)
    return {"lost": lost, "weights": weights}


def test_lora_added_after_a_zero3_from_pretrained_keeps_peft_values_and_the_checkpoint(checkpoint, plain):
    import copy

    from peft import get_peft_model

    torch.manual_seed(1)
    expected = dict(get_peft_model(copy.deepcopy(plain), _lora_config()).named_parameters())
    for r in run_on_ranks(2, _load_pretrained_with_lora, str(checkpoint), spawn=True):
        assert not r["lost"], f"PEFT's adapters were moved to meta and lost: {r['lost'][:3]}"
        lora = [n for n in expected if "lora_" in n]
        assert len(lora) == 8 and r["weights"].keys() == expected.keys()
        for name, value in expected.items():  # base weights from the checkpoint, adapters as PEFT made them
            assert torch.equal(r["weights"][name], value.detach()), name
        assert all(r["weights"][n].abs().sum() > 0 for n in lora if "lora_A" in n)

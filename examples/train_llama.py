"""Train a small Llama with zerotrain: the DeepSpeed recipe, with one import changed.

    zerotrain launch --nproc_per_node 2 examples/train_llama.py [--steps 150] [--deepspeed_config FILE]

The model is built from a config (nothing is downloaded) and the data is made
here: sequences that count up by a stride hidden in each sequence, modulo the
vocabulary. A model that infers the stride from context predicts every next
token, so the loss falls from ln(vocab) toward zero.
"""

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zerotrain  # was: import deepspeed

VOCAB, SEQ = 128, 64


class StrideSequences(torch.utils.data.Dataset):
    """Sequence i: start, start+s, start+2s, ... (mod VOCAB), with s drawn from 1..7."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (size, 1), generator=g)
        strides = torch.randint(1, 8, (size, 1), generator=g)
        self.data = (starts + strides * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--deepspeed_config", default=str(Path(__file__).with_name("ds_config.json")))
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    engine, _, loader, _ = zerotrain.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=StrideSequences(20_000)
    )
    rank0 = engine.rank == 0
    if rank0:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"Llama {n / 1e6:.2f}M params | ZeRO stage {engine.zero_optimization_stage()} | "
            f"{engine.world_size} ranks x micro batch {engine.train_micro_batch_size_per_gpu()} | "
            f"chance loss ln({VOCAB}) = {math.log(VOCAB):.2f}",
            flush=True,
        )
    step, start, first_loss = 0, time.perf_counter(), None
    epoch = 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            step += 1
            # average the loss over ranks for the printout
            reported = loss.detach().clone()
            torch.distributed.all_reduce(reported)
            reported = reported.item() / engine.world_size
            first_loss = first_loss if first_loss is not None else reported
            if rank0 and (step % 10 == 0 or step == 1):
                elapsed = time.perf_counter() - start
                print(f"step {step:4d}  loss {reported:.4f}  lr {engine.get_lr()[0]:.2e}  {elapsed:6.1f}s", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    if rank0:
        print(f"done: loss {first_loss:.3f} -> {reported:.3f} in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()

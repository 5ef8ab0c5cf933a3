"""Which bf16 ZeRO-2 update is the textbook one: zerotrain's, DeepSpeed's, or both?

A 2-layer MLP in bf16 with an fp32 master and torch's AdamW, 2 ranks, each its own batch. `eager`
computes in one process what mixed precision prescribes (bf16 gradients averaged, AdamW on the
fp32 master, copied back to bf16); `engine` runs the same through `deepspeed.initialize` at
ZeRO-2, under whichever `deepspeed` runs it. Each prints rank 0's loss before and after updates.

    python benchmarks/bf16_first_update.py eager
    zerotrain run deepspeed --num_gpus 2 benchmarks/bf16_first_update.py engine
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 benchmarks/bf16_first_update.py engine   # a venv with DeepSpeed
"""

import argparse

import torch
from torch import nn

STEPS, LR, BETAS = 3, 1e-3, (0.9, 0.95)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1, bias=False))


def _batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(4, 32, generator=generator).bfloat16() * 3 for _ in range(STEPS)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean() * 10


def eager() -> None:
    model = _model()
    master = [p.detach().float().clone() for p in model.parameters()]
    model = model.bfloat16()
    optimizer = torch.optim.AdamW(master, lr=LR, betas=BETAS)
    batches = [_batches(0), _batches(1)]
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            loss = _loss(model, batches[rank][step])
            loss.backward()
            grads.append([p.grad for p in model.parameters()])
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}")
        for m, g0, g1 in zip(master, *grads):
            m.grad = (g0 / 2 + g1 / 2).float()  # bf16 gradients, divided before the sum
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                p.copy_(m)


def engine() -> None:
    import deepspeed

    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for step, x in enumerate(_batches(rank)):
        loss = _loss(engine, x)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["eager", "engine"])
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    eager() if parser.parse_args().mode == "eager" else engine()

"""`deepspeed.compression`: only `helper`'s attribute walkers (DeepSpeed-Chat's LoRA code uses them)."""

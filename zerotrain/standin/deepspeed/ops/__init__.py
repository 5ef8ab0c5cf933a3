"""`deepspeed.ops`: pure-torch optimizers with DeepSpeed's constructor arguments; nothing compiled."""

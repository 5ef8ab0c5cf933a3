"""`deepspeed.runtime.fp16`: only what DeepSpeed's checkpoint pickles name (`loss_scaler`)."""

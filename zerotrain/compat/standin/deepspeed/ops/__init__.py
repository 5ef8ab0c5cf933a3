"""`deepspeed.ops`: pure-torch optimizers with DeepSpeed's constructor arguments; nothing compiled.
Submodules (`deepspeed.ops.adam`, ...) are imported when asked for."""

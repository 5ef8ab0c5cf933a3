"""`deepspeed.checkpoint`."""

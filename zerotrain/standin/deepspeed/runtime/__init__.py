"""`deepspeed.runtime`."""

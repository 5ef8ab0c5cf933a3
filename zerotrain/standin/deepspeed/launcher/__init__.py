"""`deepspeed.launcher`."""

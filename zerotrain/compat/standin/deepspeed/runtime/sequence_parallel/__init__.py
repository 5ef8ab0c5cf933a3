"""`deepspeed.runtime.sequence_parallel`: Ulysses sequence parallelism (zerotrain/sequence)."""

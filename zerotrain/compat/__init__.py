"""DeepSpeed's API beyond `initialize` and the engine, as the `deepspeed` stand-in hands it out
(zerotrain/standin/deepspeed/): the device facade, `deepspeed.comm` (whose `init_distributed` is
also `zerotrain.init_distributed`), and clear refusals for what zerotrain does not have."""

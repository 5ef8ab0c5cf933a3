"""DeepSpeed's API beyond `initialize` and the engine, as the `deepspeed` stand-in hands it out
(zerotrain/standin/deepspeed/): the device facade, `deepspeed.comm`, and clear refusals for
what zerotrain does not have. Nothing here is imported by `import zerotrain`."""

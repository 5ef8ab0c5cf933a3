"""Layer 4, the DeepSpeed face: what a DeepSpeed script or library finds when it asks for DeepSpeed.

`initialize.py` is `zerotrain.initialize` (DeepSpeed's `deepspeed.initialize`); `standin/` holds the
`deepspeed` package (one-line re-exports, its metadata and a `deepspeed` command) that
`deepspeed_standin.py` puts on a job's path; `accelerator.py`, `comm.py` and
`unsupported_features.py` are DeepSpeed's device facade, `deepspeed.comm` (whose
`init_distributed` is also `zerotrain.init_distributed`) and clear refusals for what zerotrain
does not have. `json_only_configs.py`, `accelerate_launch_args.py` and `compile_settings.py` check, before
a launch, what the Hugging Face libraries will do with the user's settings (a DeepSpeed JSON they
`json.load`, a dynamo backend Accelerate's DeepSpeed launcher drops). Built on the runtime below; the jobs
and the command line sit above it.
"""

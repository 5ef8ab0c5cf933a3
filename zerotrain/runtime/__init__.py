"""Layer 3, the runtime: the `Engine` (forward -> backward -> step in `engine.py`), DeepSpeed's
engine accessors, loss scaling and the step timers. Built on `zero/`, `optim/`, `checkpoint/` and
`profiling/` below it; never imports the DeepSpeed face, the jobs or the command line."""

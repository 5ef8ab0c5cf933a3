"""Planning tools: estimate memory and throughput before launching a run."""

"""Built-in training observers that measure a run: the flops profiler."""

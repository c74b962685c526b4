"""DeepSpeed's ``deepspeed.runtime`` import paths, kept for scripts that import from them."""

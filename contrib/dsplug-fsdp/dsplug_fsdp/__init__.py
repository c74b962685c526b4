"""dsplug-fsdp: the ZeRO stage ``fsdp2``, built on PyTorch FSDP2. See README.md."""

"""dsplug-mmap-offload: the offload device ``mmap`` (memory-mapped files). See README.md."""

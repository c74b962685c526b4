"""1-bit Adam, 0/1 Adam and 1-bit LAMB: communication-compressed optimizers."""

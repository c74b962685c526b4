"""DeepSpeed's progressive layer dropping (the ``progressive_layer_drop`` section): see :mod:`.plugin`."""

"""DeepSpeed's progressive layer dropping (the ``progressive_layer_drop`` section): the schedule and
its observer in :mod:`.observer`, the schema in :mod:`.config`, registered by :mod:`.plugin`."""

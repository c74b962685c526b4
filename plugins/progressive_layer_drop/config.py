"""Schema of the ``progressive_layer_drop`` section (DeepSpeed's keys and defaults)."""
from __future__ import annotations

from dsplug.config.schema import field, schema


@schema
class ProgressiveLayerDropConfig:
    enabled: bool = field(False, doc="drop transformer layers progressively during training")
    theta: float = field(0.5, gt=0.0, le=1.0,
                         doc="the keep probability theta(t) decays to (lower: faster training, less robust)")
    gamma: float = field(0.001, ge=0.0, doc="how fast theta(t) decays from 1 to theta, per global step")

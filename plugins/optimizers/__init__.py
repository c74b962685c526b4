"""Built-in optimizer plugins (category ``optimizer``, selected by ``optimizer.type``).

Feature modules (cheap to import, torch imported in factories), registered together by :mod:`.plugin`
(entry point ``optimizers``):

* :mod:`.adam`        — ``Adam`` / ``AdamW`` (DeepSpeed FusedAdam semantics, ``torch_adam``,
  ``adam_w_mode``), implemented by :class:`.adam_optimizer.FusedAdam`;
* :mod:`.lamb`        — ``Lamb`` (DeepSpeed FusedLamb semantics), :class:`.lamb_optimizer.FusedLamb`;
* :mod:`.sgd`, :mod:`.adagrad` — ``SGD`` / ``Adagrad`` with torch.optim semantics;
* :mod:`.torch_optim` — every other ``torch.optim`` class by name, its params schema derived from
  the constructor signature.
"""

"""The optimizer names and switches DeepSpeed's ``deepspeed.runtime.config`` defines as constants
(``ADAM_OPTIMIZER = "adam"`` ...), for scripts that build config dicts with them. ``optimizer.type``
matches case-insensitively, so these lower-case names select this package's optimizers:
``"adam"`` / ``"adamw"`` (:mod:`.adam`), ``"lamb"`` (:mod:`.lamb`), ``"adagrad"`` (:mod:`.adagrad`),
and ``"lion"`` the third-party ``contrib/dsplug-lion`` plugin."""

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ADAGRAD_OPTIMIZER = "adagrad"
LION_OPTIMIZER = "lion"
#: ``optimizer.params`` switch of Adam / AdamW: build torch.optim.Adam / AdamW instead of FusedAdam
TORCH_ADAM_PARAM = "torch_adam"
#: ``optimizer.params`` switch of Adam: decoupled weight decay (true, the default) or L2 (false)
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = ["ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ADAGRAD_OPTIMIZER", "LION_OPTIMIZER",
           "TORCH_ADAM_PARAM", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT"]

"""``dsplug deepspeed-alias enable | disable | status``: serve the ``deepspeed`` name from dsplug.

``import dsplug as deepspeed`` covers a user's own script, but libraries such as transformers and
accelerate import ``deepspeed`` themselves and check its distribution metadata
(``importlib.metadata.version("deepspeed")``, a ``deepspeed>=0.9.3`` requirement). Opting in with
``dsplug deepspeed-alias enable`` writes, into the current environment's site-packages:

* ``deepspeed/__init__.py`` -- a shim that installs :class:`.finder.AliasFinder` and makes
  ``import deepspeed`` return dsplug's namespace (every attribute is dsplug's; ``__version__`` is
  the alias distribution's); every ``deepspeed.X`` then resolves to the module object ``dsplug.X``
  (shared state: ``deepspeed.comm is dsplug.comm``);
* ``deepspeed-<API>+dsplug.<version>.dist-info`` -- distribution metadata whose version states the
  DeepSpeed API level dsplug implements (:data:`DEEPSPEED_API_VERSION`) with dsplug's version as
  the PEP 440 local part, a RECORD of every file written (``pip uninstall deepspeed`` works too)
  and the ``deepspeed`` console script;
* ``<scripts>/deepspeed`` -- the launcher command, ``dsplug launch`` under DeepSpeed's name.

Nothing of this exists until ``enable`` runs; ``disable`` removes exactly those files. A real
DeepSpeed in the environment is never touched: ``enable`` and ``disable`` refuse.

The pieces: :mod:`.finder` (the import aliasing, imported by the shim), :mod:`.install` (what
enable / disable / status do), :mod:`.launcher` (the ``deepspeed`` command), :mod:`.cli` (the
``dsplug deepspeed-alias`` command), :mod:`.plugin` (registers it; entry point ``deepspeed-alias``).
"""

#: The DeepSpeed API level dsplug implements: the public version of the ``deepspeed`` distribution
#: the alias writes (``0.19.8+dsplug.0.1.0``). The one place this number lives.
DEEPSPEED_API_VERSION = "0.19.8"

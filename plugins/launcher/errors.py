"""The launcher's user-facing error: bad hostfile, bad resource filter, bad option combination."""
from __future__ import annotations


class LaunchError(ValueError):
    """Raised before anything starts; the message names the file / flag / value at fault."""

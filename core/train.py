"""``python -m dsplug.train [options]``: the same as ``dsplug train [options]``.

The job is the ``train`` plugin (:mod:`dsplug.plugins.train`, which contributes the ``train``
command); this module only keeps the ``python -m`` spelling working, through the ``dsplug``
command line, so a blocked or uninstalled plugin is reported there.
"""
import sys

if __name__ == "__main__":
    from dsplug.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))

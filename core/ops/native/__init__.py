"""Python side of the native ops: argument checks, the calls into the extensions, and the
pure-torch (or pure-Python) fallbacks with the same interface. ``OpBuilder.load()`` returns
objects from here."""

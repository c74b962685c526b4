"""A dsplug monitor that writes one JSON line per event and keeps a loss EMA across restarts."""
__version__ = "0.1.0"

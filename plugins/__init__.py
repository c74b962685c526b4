"""Built-in plugins. Each registers through dsplug's own entry points, like any third party."""

"""Kiln core: vocabulary shared by every layer (errors, settings, build spec, keys, database models).

Nothing in this package imports the layers above it (artifacts, validation, builder, workers, api).
"""

__version__ = "0.1.0"

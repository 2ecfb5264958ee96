"""rampserve: a model server with managed early exits."""

__version__ = "0.1.0"

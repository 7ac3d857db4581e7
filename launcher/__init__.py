"""launcher: train a PyTorch model described by one YAML recipe, on one device or many.

Importing this package is cheap on purpose: torch, tensorboard and accelerate are
imported by the modules that need them, when they need them.
"""

__version__ = "0.1.0"

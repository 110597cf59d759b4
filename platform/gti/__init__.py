"""gti: grounded token initialization for generative recommendation, on Ray."""

__version__ = "0.1.0"

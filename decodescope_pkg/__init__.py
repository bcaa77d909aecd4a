"""decodescope: per-layer kernel counts and microseconds for the decode step of LLMs.

The subpackages live in the repository's top-level folders (tracer/, kernels/, analysis/, ui/)
and are installed as ``decodescope.tracer`` and so on; always import them by that name.
"""

__version__ = "0.1.0"

"""The instrumented workloads: model config, standard layers, specialized CuTe DSL kernels.

Imports nothing of decodescope but ``decodescope.tracer``'s range API.
"""

"""Wafer execution: the engine's weights partitioned over an emulated grid of processing elements.

- :mod:`.partition` — ``TiledLinear``: the per-PE tiled linear emitter the engine runs by default
- :mod:`.mesh_op` — builds ``mesh_op.c``, the ONNX Runtime op that runs a tiled linear

What the same layout would reach on a real wafer (chips, placement, the performance model, the
simulator, the picture) is :mod:`engine.projection`, which the runtime never imports.
"""

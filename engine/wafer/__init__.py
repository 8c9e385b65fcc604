"""The wafer grid: placement of a model over wafer-scale meshes, partitioned execution, and
projections.

- :mod:`.chips` — WSE-2 / WSE-3 and custom chip specs
- :mod:`.partition` — ``TiledLinear``: the engine's per-PE tiled linear emitter (execution)
- :mod:`.mesh_op` — builds ``mesh_op.c``, the ONNX Runtime op that runs a tiled linear
- :mod:`.placement` — layer-pipelined regions, SRAM budget, multi-wafer cuts
- :mod:`.perfmodel` — analytic decode / TTFT projection, calibrated to WaferLLM
- :mod:`.simulator` — discrete mesh simulator of one layer's decode step
- :mod:`.draw` — the wafer picture; :mod:`.bench` — ``spark-lsp bench wafer``

Submodules are imported on demand (the engine imports only ``partition``, which imports ``mesh_op``).
"""

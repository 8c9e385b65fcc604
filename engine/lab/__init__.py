"""The lab: everything that measures the engine (the runtime core never imports it).

- :mod:`.bench` — ``spark-lsp bench engine`` (against transformers and onnxruntime-genai)
- :mod:`.bench_edits` — ``spark-lsp bench edits`` (speculative edits vs plain decoding)
- :mod:`.bench_profile` — ``spark-lsp bench profile`` (a decode step's time per ONNX operator)
- :mod:`.bench_wafer` — ``spark-lsp bench wafer`` (partitioned vs dense execution, projection)
- :mod:`.evaluate` — ``spark-lsp eval`` (fill-in-the-middle line completion, bits per byte)
- :mod:`.tune` — ``spark-lsp tune`` (measures and stores the precision decision)
- :mod:`.precisions` — per-precision diagnostics (``python -m engine.lab.precisions``)
- :mod:`.peers` — the peers benchmarks compare with; :mod:`.models` — synthetic reference models
"""

"""spark-lsp inference engine: model folder -> ONNX decoder -> ONNX Runtime, with KV cache reuse."""

"""welltempered service: REST API, registry, background fits and ONNX Runtime serving."""

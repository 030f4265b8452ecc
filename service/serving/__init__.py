"""Serving calibrated probabilities through ONNX Runtime."""

"""Observability: Prometheus metrics, calibration monitoring, SVG charts."""

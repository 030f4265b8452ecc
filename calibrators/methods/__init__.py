"""The calibration methods: one module per method name of the registry.

Each module holds one calibrator class; `_linear.py` and `_structured.py` hold the fits
that vector/matrix/Dirichlet scaling and SVS/SMS share. The registry is
`calibrators.CALIBRATORS`: a new method is one module here and one line there.
"""

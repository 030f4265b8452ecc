"""Fit jobs: the fit function and the processes that run it."""

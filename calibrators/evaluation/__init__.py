"""Evaluation of calibrated probabilities: metrics, the argmax and NLL checks, drift
verdicts, and the one hold-out split."""

"""Request and answer bodies, decoded and encoded: .npy, .npz, JSON and the Open Inference
Protocol, each a pure module (no web framework) bounded before it allocates, fuzzed
directly (tests/security/harness.py, bench/fuzz_parsers.py)."""

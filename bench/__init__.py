"""Benchmarks that measure ckptd against its peers side by side, in one run, as ratios."""

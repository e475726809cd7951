"""Tiny standard-library evals for tests, the demo and the benchmarks.

Entrypoints: ``jupyter_evalsched.examples.basic:noop``, ``:sleepy``, ``:accuracy_toy`` and
``:crash`` (see ``basic.py``).
"""

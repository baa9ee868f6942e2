"""Benchmarks of fastla against FLA 0.6.0: config registry, inputs, runner and report.

- :mod:`fastla.bench.registry`: the named configs (no torch needed to list them).
- :mod:`fastla.bench.inputs`: deterministic realistic inputs and the FLOP/byte model.
- :mod:`fastla.bench.runner`: ``main(argv)``, the ``python -m fastla bench`` entry point.
- :mod:`fastla.bench.report`: markdown tables, plots and the README block from JSON.

Importing this package needs neither a GPU nor Triton's testing helpers.
"""
from fastla.bench.registry import CONFIGS, BenchConfig, get_config, select_configs

__all__ = ["CONFIGS", "BenchConfig", "get_config", "select_configs"]

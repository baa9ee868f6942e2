"""Entry point of ``python -m fastla``; see :mod:`fastla.cli`."""
import sys

from fastla.cli import main

sys.exit(main())

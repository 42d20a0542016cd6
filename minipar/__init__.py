"""minipar: model parallelism by hand, in NumPy and mpi4py, proven equal to one process.

Start with `python -m minipar train --help`, `make demo`, and the lessons in `lessons/`.
"""

__version__ = "0.1.0"

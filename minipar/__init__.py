"""minipar: model parallelism by hand, in NumPy and mpi4py, proven equal to one process.

Start with `python -m minipar train --help`, `make demo`, and the lessons in `lessons/`.
"""

import ctypes

__version__ = "0.1.0"


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse instead of returning them to the OS.

    Every step the tape frees megabytes of activations and gradients and allocates
    them again. By default glibc hands blocks above a threshold back to the kernel
    (munmap) and the next step pays page faults to get them back, which measured
    10-25% of a step of the 784-1024-1024-10 MLP here. Raising the thresholds keeps
    them in the process, for the same reason PyTorch keeps a caching allocator.
    Linux/glibc only; elsewhere nothing happens. Returns whether it took effect."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameter numbers (malloc.h)
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)
                    and libc.mallopt(m_trim_threshold, 1 << 31))
    except (OSError, AttributeError):
        return False


reuse_freed_memory()

from minipar.core.threads import one_blas_thread  # noqa: E402  (after the allocator)

one_blas_thread()

"""Large CPU tensors without page faults: glibc's malloc told to keep big freed blocks.

glibc serves an allocation above its mmap threshold (at most 32 MiB by default) with a fresh
mmap and unmaps it on free, so each step's largest temporaries (a 256-row step's logits are
256 x 49,152 float32 = 48 MiB, and the sampler makes several more of that size) come back as
new pages that the kernel zero-fills on first touch, every step. On an AMD EPYC (AVX-512),
one thread: casting a bf16 [256, 49152] tensor to float32 took 24.6 ms, 2.4 ms once the
threshold was raised; the bf16 LM head with its cast 92.6 -> 70.8 ms; a whole 256-row decode
step of the default model (ModelRunner, 2 threads) 323-330 -> 309-311 ms on the bf16 CPU math,
unchanged on float32 (its logits come straight from oneDNN). `keep_large_allocations`
raises the mmap and trim thresholds (mallopt) so those blocks stay in the heap and are reused:
the process's resident memory then stays near its peak instead of shrinking between steps,
which is what a worker serving batches wants. Called once per process by the engine on CPU;
where the C library is not glibc it does nothing.

`huge_page_zeros` allocates the K/V pool (engine/kv_cache.py) on 2 MiB pages where the kernel
allows them for the asking (transparent huge pages in "madvise" mode, the common default; "always"
needs no asking, "never" gives none): a decode step's attention reads each sequence's own blocks,
scattered through a pool of gigabytes, so with 4 KiB pages nearly every block read is also a TLB
miss. On a 2-core AMD EPYC Zen 5, `bench.engine --skip-hf` alternating with and without it: 1423.2
/ 1430.1 against 1355.8 / 1361.2 output tok/s (the 256-row attention calls 5.57 / 5.51 s against
5.78 / 5.60 s of the run). The price is paid once, at start-up: the kernel clears (and, to find
free 2 MiB runs, may compact) each huge page as it is first touched, so zeroing that 4.3 GB pool
took 2.7 s against 1.4 s on 4 KiB pages there.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import warnings

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30          # blocks up to 1 GiB come from the heap and stay there when freed


@functools.cache
def keep_large_allocations() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where that is not
    possible (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    if not done:
        log.warning("could not raise malloc's mmap threshold: large CPU tensors page-fault every step")
    return done


HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on memory of its own (an anonymous private mapping, so no page of it was
    touched before) that is asked to be huge pages before its first touch (MADV_HUGEPAGE); where
    that is not possible (no such madvise, a tensor under 2 MiB), torch.zeros. The tensor starts on
    a 2 MiB boundary of a mapping 2 MiB longer than it (Linux places a mapping of this size on any
    4 KiB boundary, and only whole aligned 2 MiB runs can be huge pages: a 3.5 MiB tensor at an
    offset below 0.5 MiB held none). The mapping lives as long as the tensor."""
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % HUGE_PAGE
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError as error:      # the kernel has no transparent huge pages: ordinary pages then
        log.debug("madvise(MADV_HUGEPAGE) refused (%s): the K/V pool stays on 4 KiB pages", error)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # frombuffer's note that the tensor shares the buffer
        tensor = torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(shape)
    return tensor.zero_()          # every page faulted in now, at load, not in the first steps

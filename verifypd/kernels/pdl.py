"""Programmatic dependent launch (PDL, Hopper and newer) for the decode-path kernels.

A CUDA-graph decode step of a small model is hundreds of short kernels, and the GPU idles for
about a microsecond between each pair while the next grid is launched. With PDL a kernel is
launched while its predecessor in the stream is still running: its programs start, call
``griddepcontrol.wait`` before their first memory access, and so begin the moment the
predecessor's writes are visible. Every PDL kernel also signals at its start that its own
successor may launch. Waiting before *any* access (reads and writes) keeps it safe when a
buffer is reused by the caching allocator; kernels launched without PDL (cuBLAS, torch ops)
simply run after their predecessor as usual.

``launch_options(device, use_pdl)`` gives the extra launch arguments of a kernel that calls
``wait_for_previous(USE_PDL)`` first; ``use_pdl`` is ``KernelConfig.pdl`` (benchmarks A/B it),
passed down by each kernel wrapper.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # an older Triton: no grid dependency control
    AVAILABLE = False

_SUPPORTED: dict[int, bool] = {}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible; let the next kernel launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_options(device: torch.device, use_pdl: bool = True) -> dict[str, bool]:
    """``USE_PDL`` (the kernel's constexpr) and ``launch_pdl`` (Triton's launch option): on
    where asked for (``use_pdl``) and the device and Triton support it."""
    use = use_pdl and AVAILABLE and device.type == "cuda" and _supported(device)
    return {"USE_PDL": use, "launch_pdl": use}


def _supported(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SUPPORTED:
        _SUPPORTED[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _SUPPORTED[index]

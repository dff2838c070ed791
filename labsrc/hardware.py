"""Published figures of the accelerators the lab talks about (dense, no sparsity).

Used by the KV-cache chapter's bandwidth floor and by the kernel bench's "fraction of peak" column.
Each entry names its source so a reader can check it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float          # HBM capacity, in 10^9 bytes as vendors state it
    hbm_gbps: float           # peak HBM bandwidth, 10^9 bytes/s
    bf16_tflops: float        # dense bf16/fp16 tensor-core peak, 10^12 FLOP/s
    fp32_tflops: float        # non-tensor-core fp32 peak
    source: str


ACCELERATORS: dict[str, Accelerator] = {
    "A100-80GB": Accelerator("A100-80GB", 80, 2039, 312, 19.5,
                             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
    "H100-SXM": Accelerator("H100-SXM", 80, 3350, 989, 67,
                            "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "H200": Accelerator("H200", 141, 4800, 989, 67,
                        "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
}


def lookup(device_name: str) -> Accelerator | None:
    """The accelerator whose name appears in ``device_name`` (e.g. ``torch.cuda.get_device_name()``), or None.

    Raises ``TypeError`` naming ``device_name`` when it is not a string."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str such as torch.cuda.get_device_name(), got "
                        f"{type(device_name).__name__}")
    text = device_name.upper().replace(" ", "")
    for key, keywords in (("H200", ("H200",)), ("H100-SXM", ("H100",)), ("A100-80GB", ("A100",))):
        if any(k in text for k in keywords):
            return ACCELERATORS[key]
    return None

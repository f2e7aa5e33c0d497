"""Mixed precision and offload policies.

fsdp-rs accepts torch's own policy classes, so code written for FSDP2 passes the
same objects; they are re-exported here and from ``fsdp_rs``.
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]

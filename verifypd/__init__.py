"""verifypd: an LLM serving engine with three priority lanes and lossless speculative decoding."""

from verifypd.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig, SpecConfig
from verifypd.types import RequestOutput, SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "KernelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpecConfig",
]
__version__ = "0.1.0"

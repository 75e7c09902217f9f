"""inflight: an LLM inference engine and server built around continuous batching."""

from inflight.config import CacheConfig, EngineConfig, SchedulerConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.llm import LLM, CompletionOutput
from inflight.errors import ConfigError, InflightError, InvalidRequestError, ModelLoadError
from inflight.request import FinishReason, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "FinishReason",
    "InflightError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "SamplingParams",
    "SchedulerConfig",
]

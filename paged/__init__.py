"""paged: PagedAttention from first principles. A small, real inference engine with vLLM's offline API."""

from .config import EngineConfig
from .engine import LLM, LLMEngine
from .lora import LoRARequest
from .sampling import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "LoRARequest", "SamplingParams"]

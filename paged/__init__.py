"""paged: PagedAttention from first principles. A small, real inference engine with vLLM's offline API."""

from paged.config import EngineConfig
from paged.engine.llm import LLM
from paged.engine.llm_engine import LLMEngine
from paged.lora import LoRARequest
from paged.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "LoRARequest", "SamplingParams"]

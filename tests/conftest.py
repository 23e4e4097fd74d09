"""Shared fixtures: the real SmolLM2 (loaded once per session) and a tiny random Llama for fast engine tests."""

import pytest
import torch
from helpers import tiny_llama

from paged.model.loader import chat_prompt, load_hf_model

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers.",
    "Why is the sky blue? Answer in detail, covering Rayleigh scattering and the role of the atmosphere.",
    "Translate 'good morning' into French, Spanish and German.",
    "Tell me a short story about a robot who learns to paint, in about five sentences.",
]


@pytest.fixture(scope="session")
def smollm2():
    """(hf_model, tokenizer) for SmolLM2-135M-Instruct in fp32."""
    return load_hf_model()


@pytest.fixture(scope="session")
def chat_prompts(smollm2):
    _, tokenizer = smollm2
    return [chat_prompt(tokenizer, q) for q in CHAT_QUESTIONS]


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny matmuls: on a machine other processes load, torch's thread pool costs
    more than it gives. A module asks for it with pytestmark = pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

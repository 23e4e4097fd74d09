"""What differs between the Llama-family decoders the engine runs (guide §2): one description per architecture.

Llama, Mistral, Qwen2 and Qwen3 are the same decoder: RMSNorm, fused QKV, RoPE, attention, O, RMSNorm, SiLU-gated
MLP. They differ in a few switches, and only these switches; the forward pass (model/llama.py) reads them:

    LlamaForCausalLM     the reference (Llama 2/3, SmolLM2), any RoPE scaling with one table for every position
    MistralForCausalLM   + a sliding window: attention sees the last `sliding_window` tokens only
    Qwen2ForCausalLM     + biases on q, k and v (none on o)
    Qwen3ForCausalLM     + an RMSNorm over each head of q and of k, before RoPE; head_dim given by the config

The weights keep transformers' names; `layer_tensors` says which of a layer's tensors stack, row after row, into
each of the engine's fused ones (q, k, v -> qkv; gate, up -> gate_up). Anything else is refused by name
(`check_supported`), listing what is supported, rather than run as if it were a Llama.
"""

import warnings
from dataclasses import dataclass

ACTIVATIONS = ("silu", "swish")  # one function under two names (transformers' ACT2FN)
LENGTH_DEPENDENT_ROPE = ("longrope",)  # short or long factors by the sequence's length: no table for all of it


@dataclass(frozen=True)
class Architecture:
    name: str  # transformers' class, as config.architectures names it
    model_type: str  # config.model_type
    rotary: str  # transformers' rotary-embedding class in the model's module, built from the config
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj
    qk_norm: bool = False  # RMSNorm (one weight of head_dim) on every head of q and of k, before RoPE
    sliding_window: bool = False  # the config's sliding_window can limit attention (see `max_model_len`)

    def layer_tensors(self) -> dict[str, tuple[str, ...]]:
        """Each engine tensor of a layer -> transformers' tensors (under model.layers.{i}.) stacked into it."""
        names = {
            "input_norm": ("input_layernorm.weight",),
            "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "o": ("self_attn.o_proj.weight",),
            "post_norm": ("post_attention_layernorm.weight",),
            "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "down": ("mlp.down_proj.weight",),
        }
        if self.qkv_bias:
            names["qkv_bias"] = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
        if self.qk_norm:
            names["q_norm"], names["k_norm"] = ("self_attn.q_norm.weight",), ("self_attn.k_norm.weight",)
        return names


ARCHITECTURES = {
    arch.name: arch
    for arch in [
        Architecture("LlamaForCausalLM", "llama", "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding"),
        Architecture(
            "MistralForCausalLM",
            "mistral",
            "transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding",
            sliding_window=True,
        ),
        Architecture(
            "Qwen2ForCausalLM",
            "qwen2",
            "transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
            qkv_bias=True,
            sliding_window=True,
        ),
        Architecture(
            "Qwen3ForCausalLM",
            "qwen3",
            "transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
            qk_norm=True,
            sliding_window=True,
        ),
    ]
}


def head_dim(config) -> int:
    """The config's head_dim (None or absent: hidden_size // num_attention_heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a layer may have, by its name under model.layers.{i}., from the config."""
    hidden, inter, dim = config.hidden_size, config.intermediate_size, head_dim(config)
    q, kv = (
        config.num_attention_heads * dim,
        (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * dim,
    )
    return {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (dim,),
        "self_attn.k_norm.weight": (dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def check_supported(class_name: str, config, argument: str = "model") -> Architecture:
    """The description of a model of transformers class `class_name`; a ValueError naming `argument` and the
    setting if it is not one the forward pass runs exactly as transformers does."""
    arch = ARCHITECTURES.get(class_name)
    model_type = getattr(config, "model_type", None)
    if arch is None or arch.model_type != model_type:
        raise ValueError(
            f"{argument} is a {class_name} (model_type {model_type!r}); the engine runs {supported()} only"
        )
    for setting in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its architecture, not a setting
        if getattr(config, setting, False):
            raise ValueError(
                f"{argument} has {setting}=True: the engine's projections of a {class_name} have no "
                f"bias, so it would run the model wrongly; it runs {setting}=False only"
            )
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"{argument} has hidden_act={config.hidden_act!r}: the engine's MLP is SiLU-gated; it "
            f"runs hidden_act 'silu' only"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"{argument} has a RoPE of type {rope_type!r}, whose frequencies depend on the sequence's "
            f"length; the engine computes one RoPE table for every position and cannot run it"
        )
    return arch


def max_model_len(arch: Architecture, config) -> int:
    """The longest sequence the engine runs: max_position_embeddings, capped at the sliding window when one applies.

    Within its window a sliding-window layer attends to every earlier token, exactly like full causal attention; the
    engine has no window in its kernels, so it runs such a model only up to the window's length, with a warning
    when that is shorter than max_position_embeddings (Mistral-7B-v0.1: 4096 of 32768; later Mistrals have none).
    """
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None) if arch.sliding_window else None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # Qwen: use_sliding_window with max_window_layers past the last layer slides nowhere
    if window is not None and window < limit:
        warnings.warn(
            f"the model has sliding_window={window} < max_position_embeddings={limit}; the engine has no "
            f"sliding-window attention, so it caps max_model_len at {window} tokens, where the window "
            f"still covers every earlier token",
            stacklevel=3,
        )
        return window
    return limit

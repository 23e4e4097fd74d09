"""Bring your own model (model/checkpoints.py, model/loader.py, model/architectures.py): Llama, Mistral, Qwen2, Qwen3 folders against transformers.

Every model is random, with awkward shapes: GQA 1:1 and 4:1, head_dim 64 and 128 (explicit, unlike hidden_size /
heads, where the config allows it), one or three layers, a vocabulary of 331 (not a multiple of 64), tied and untied
embeddings, Llama 3's RoPE scaling, a Mistral sliding window; every norm weight and Qwen2 bias is random, so a
norm or a bias applied in the wrong place changes the tokens. Each is saved with save_pretrained, in one fp32 file
and in bf16 shards, and transformers' AutoModelForCausalLM.from_pretrained on the same folder is the oracle.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_near_tie, assert_pool_empty, hf_logits
from safetensors.torch import load_file, save_file

from paged import LLM, LoRARequest, SamplingParams
from paged.geometry import KVGeometry
from paged.model.architectures import ARCHITECTURES

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 331  # > the tokenizer's 300 words, as real models pad theirs; not a multiple of 64
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED = list(range(3, 27))  # a 24-token prefix the prompts share: the prefix cache has work to do
PROMPTS = [SHARED + [40, 41, 42], SHARED + [7] * 9, SHARED + list(range(100, 117)), [5, 6, 7]]
ENGINE = dict(
    block_size=8,
    num_blocks=12,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    device="cpu",
)  # 4 sequences of up to 51 tokens: preemption

COMMON = dict(
    vocab_size=VOCAB,
    intermediate_size=160,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {  # name: (transformers class prefix, settings)
    "llama-1to1-hd64": (
        "Llama",
        dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_hidden_layers=3,
            tie_word_embeddings=False,
        ),
    ),
    "llama-4to1-hd128-llama3rope": (
        "Llama",
        dict(
            hidden_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            num_hidden_layers=1,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 500000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-1to1-hd64": (
        "Mistral",
        dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3, sliding_window=None),
    ),
    "mistral-4to1-hd128-window": (
        "Mistral",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            num_hidden_layers=1,
            sliding_window=128,
        ),
    ),
    "qwen2-1to1-hd128": (
        "Qwen2",
        dict(
            hidden_size=128, num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=3, tie_word_embeddings=True
        ),
    ),
    "qwen2-4to1-hd64": (
        "Qwen2",
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_hidden_layers=1,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-1to1-hd64": (
        "Qwen3",
        dict(
            hidden_size=96,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            num_hidden_layers=3,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-4to1-hd128": (
        "Qwen3",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            num_hidden_layers=1,
            tie_word_embeddings=False,
        ),
    ),
}


def save_tokenizer(folder) -> None:
    """A 300-word tokenizer ("w0".."w296" and three specials), in transformers' format."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


def random_model(name: str, seed: int = 0):
    """The named random model, with every 1-D weight (norms, biases) random too."""
    prefix, settings = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**COMMON, **settings)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(
                    torch.randn_like(param) * (0.5 if param_name.endswith("bias") else 0.2)
                    + (0 if param_name.endswith("bias") else 1)
                )
    return model


def save(model, folder: Path, dtype=torch.float32, shards: bool = False) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.to(dtype).save_pretrained(folder, max_shard_size="100KB" if shards else "1GB")
    model.to(torch.float32)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> {"fp32": one fp32 file, "bf16": bf16 shards}, made on first use."""
    made: dict[str, dict[str, Path]] = {}

    def get(name):
        if name not in made:
            root, model = tmp_path_factory.mktemp(name), random_model(name)
            made[name] = {"fp32": save(model, root / "fp32"), "bf16": save(model, root / "bf16", torch.bfloat16, True)}
        return made[name]

    return get


def hf_greedy(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(hf_logits(model, ids).argmax()))
    return ids[len(prompt) :]


def load_engine(folder, **kwargs) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Mistral's sliding-window cap (tested on its own below)
        return LLM(model=str(folder), **{**ENGINE, **kwargs})


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("name", MODELS)
def test_an_fp32_folder_equals_transformers(folders, name):
    folder = folders(name)["fp32"]
    assert len(list(folder.glob("*.safetensors"))) == 1
    llm = load_engine(folder)
    assert llm.engine.model.dtype == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [hf_greedy(hf, p) for p in PROMPTS]
    stats = llm.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_shards_equal_transformers_in_bf16_up_to_near_ties(folders, name):
    """bf16 rounds differently along the engine's path (fused projections, chunked prefill); where a token differs
    from transformers', transformers itself must rank the two within a bf16-sized margin, and the sequences part."""
    folder = folders(name)["bf16"]
    assert len(list(folder.glob("*.safetensors"))) > 2 and (folder / "model.safetensors.index.json").is_file()
    assert load_engine(folder, num_blocks=64).engine.model.dtype == torch.float32  # the default on a CPU
    llm = load_engine(folder, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    for prompt, ours in zip(PROMPTS, tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))):
        assert_near_tie(name, hf, prompt, ours, hf_greedy(hf, prompt))
    assert llm.kv_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["qwen2-4to1-hd64", "qwen3-1to1-hd64"])
def test_lora_on_a_qwen_equals_peft(folders, name, tmp_path):
    """Adapters on every projection: Qwen2's LoRA adds after the bias, Qwen3's before the q/k norms."""
    from peft import LoraConfig, get_peft_model

    folder = folders(name)["fp32"]
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.4 / param.shape[-1] ** 0.5))
    peft_model.save_pretrained(tmp_path / "adapter")
    llm = load_engine(folder, enable_lora=True, max_lora_rank=8)
    request = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[request, None, request, None])
    peft_model.eval()
    with_adapter = {i: hf_greedy(peft_model, PROMPTS[i]) for i in (0, 2)}
    with peft_model.disable_adapter():
        without = {i: hf_greedy(peft_model, PROMPTS[i]) for i in (1, 3)}
    expected = [{**with_adapter, **without}[i] for i in range(4)]
    assert tokens(outputs) == expected


def test_a_qwen3_drafts_for_a_qwen3(folders):
    """A draft model of the same family (another Qwen3, with the target's vocabulary) leaves greedy tokens as
    the target alone makes them; the target's own folder as its draft shares its weights and is always accepted."""
    target, other = folders("qwen3-1to1-hd64")["fp32"], folders("qwen3-4to1-hd128")["fp32"]
    plain = tokens(load_engine(target).generate(PROMPTS, GREEDY, use_tqdm=False))
    for draft, everything_accepted in [(other, False), (target, True)]:
        llm = load_engine(
            target,
            num_blocks=24,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        )
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
        stats = llm.spec_stats()
        assert stats["num_draft_tokens"] > 0
        assert (stats["num_accepted_tokens"] == stats["num_draft_tokens"]) == everything_accepted
        if everything_accepted:
            assert llm.engine.speculator.drafter.model.layers[0].qkv is llm.engine.model.layers[0].qkv


def test_swap_preemption_on_a_qwen2(folders):
    folder = folders("qwen2-1to1-hd128")["fp32"]
    expected = tokens(load_engine(folder, num_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = load_engine(folder, preemption_mode="swap", swap_space=0.01)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert llm.kv_stats()["swap_out_blocks"] > 0


@pytest.mark.parametrize("name", MODELS)
def test_the_geometry_of_every_architecture(folders, name):
    prefix, settings = MODELS[name]
    config = transformers.AutoConfig.from_pretrained(folders(name)["fp32"])
    geometry = KVGeometry.from_config(config, torch.bfloat16)
    head_dim = settings.get("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (
        settings["num_hidden_layers"],
        settings["num_key_value_heads"],
        head_dim,
    )
    llm = load_engine(folders(name)["fp32"], dtype=torch.bfloat16)
    assert llm.kv_stats()["bytes_per_block"] == geometry.block_bytes(ENGINE["block_size"])


def test_a_sliding_window_shorter_than_the_model_caps_max_model_len(folders):
    folder = folders("mistral-4to1-hd128-window")["fp32"]
    with pytest.warns(UserWarning, match="sliding_window=128 < max_position_embeddings=256.*128 tokens"):
        llm = LLM(model=str(folder), **ENGINE)
    assert llm.engine.max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 140))], GREEDY, use_tqdm=False)
    assert len(llm.generate(["w5 w6 w7"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_text_prompts_use_the_folders_tokenizer(folders):
    llm = load_engine(folders("llama-1to1-hd64")["fp32"])
    out = llm.generate(["w10 w11 w12"], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [13, 14, 15]
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_a_model_in_the_hugging_face_cache_is_read_offline(folders, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-qwen3" / "snapshots" / ("0" * 40)
    snapshot.parent.mkdir(parents=True)
    os.symlink(folders("qwen3-1to1-hd64")["fp32"], snapshot)
    (cache / "models--someone--tiny-qwen3" / "refs").mkdir()
    (cache / "models--someone--tiny-qwen3" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert tokens(load_engine("someone/tiny-qwen3").generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == tokens(
        load_engine(snapshot).generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    )
    with pytest.raises(
        ValueError, match=f"'someone/absent' is none of them \\(looked in {cache}; nothing is ever downloaded"
    ):
        LLM(model="someone/absent", device="cpu")


# ---- bad folders ---------------------------------------------------------------------------------------------------


def copy_folder(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


BAD_FOLDERS = {
    "no config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "unsupported": (
        lambda f: edit_config(f, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"),
        "GPTNeoXForCausalLM .*runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM only",
    ),
    "mlp bias": (lambda f: edit_config(f, mlp_bias=True), "mlp_bias"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "neither model.safetensors nor"),
    "missing tensor": (
        lambda f: edit_weights(f, lambda t: t.pop("model.layers.2.mlp.down_proj.weight")),
        "missing tensor 'model.layers.2.mlp.down_proj.weight'",
    ),
    "unexpected tensor": (
        lambda f: edit_weights(f, lambda t: t.update(extra=torch.zeros(3))),
        "unexpected tensor 'extra'",
    ),
    "wrong shape": (
        lambda f: edit_config(f, intermediate_size=96),
        "tensor 'model.layers.0.mlp.\\w+_proj.weight' in model.safetensors has shape \\((160, 128|128, 160)"
        "\\); config.json says \\((96, 128|128, 96)\\)",
    ),
    "integer weights": (
        lambda f: edit_weights(f, lambda t: t.update({"model.norm.weight": torch.ones(128, dtype=torch.int32)})),
        "'model.norm.weight' in model.safetensors has dtype I32",
    ),
    "truncated": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
        "truncated",
    ),
    "bad tokenizer": (lambda f: (f / "tokenizer.json").write_text("{not json"), "the tokenizer in .* cannot be read"),
}


@pytest.mark.parametrize("problem", BAD_FOLDERS)
def test_a_bad_folder_is_a_value_error_naming_the_problem(folders, tmp_path, problem):
    folder = copy_folder(folders("llama-1to1-hd64")["fp32"], tmp_path / "model")
    change, message = BAD_FOLDERS[problem]
    change(folder)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder), device="cpu")


def test_a_missing_shard_is_named(folders, tmp_path):
    folder = copy_folder(folders("qwen2-1to1-hd128")["bf16"], tmp_path / "model")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"names {shard.name}, which is missing"):
        LLM(model=str(folder), device="cpu")


def test_the_command_line_runs_a_folder(folders, capsys):
    from paged.__main__ import main

    folder = folders("qwen3-1to1-hd64")["fp32"]
    main(["generate", "--model", str(folder), "--max-tokens", "4", "--num-blocks", "32", "--device", "cpu", "w10 w11"])
    expected = (
        load_engine(folder)
        .generate(["w10 w11"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
        .outputs[0]
        .text.strip()
    )
    assert capsys.readouterr().out == f"> w10 w11\n{expected}\n\n"  # no chat template: the prompt as it is
    main(["demo", "--model", str(folder), "--max-tokens", "4", "--num-blocks", "64", "--device", "cpu"])
    assert capsys.readouterr().out.startswith(f"{folder} on cpu, 64 blocks of 16 tokens")


# ---- memory: the weights, once ------------------------------------------------------------------------------------

PEAK_SCRIPT = textwrap.dedent("""
    import gc, sys, torch
    from pathlib import Path
    from paged.model.checkpoints import read_config
    from paged.model.loader import load_model

    def kib(field):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

    for folder in map(Path, sys.argv[1:]):
        read_config(folder)                                  # the imports, before the measurement
        import transformers.models.llama.modeling_llama
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")        # VmHWM := VmRSS
        before = kib("VmRSS")
        model, _ = load_model(folder, None, torch.device("cpu"), torch.float32, "torch", with_tokenizer=False)
        tensors = [model.embed_tokens, model.final_norm, model.lm_head]
        tensors += [t for layer in model.layers for t in vars(layer).values() if t is not None]
        weights = sum(t.nbytes for t in {id(t): t for t in tensors}.values())
        print(weights, (kib("VmHWM") - before) * 1024)
        del model, tensors
""")


def test_loading_holds_the_weights_once(tmp_path):
    """A 100 M-parameter Llama (fp32 in the engine: 400 MB), from one fp32 file and from one bf16 file: the
    process's peak memory grows by less than 1.5x the weights (a second copy of them would be 2x)."""
    config = transformers.LlamaConfig(
        vocab_size=32003,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=9,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    config.architectures = ["LlamaForCausalLM"]
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (32003, 768), "model.norm.weight": (768,)}
    for index in range(9):
        shapes.update(
            {
                f"model.layers.{index}.{name}": shape
                for name, shape in {
                    "input_layernorm.weight": (768,),
                    "post_attention_layernorm.weight": (768,),
                    "self_attn.q_proj.weight": (768, 768),
                    "self_attn.k_proj.weight": (256, 768),
                    "self_attn.v_proj.weight": (256, 768),
                    "self_attn.o_proj.weight": (768, 768),
                    "mlp.gate_proj.weight": (3072, 768),
                    "mlp.up_proj.weight": (3072, 768),
                    "mlp.down_proj.weight": (768, 3072),
                }.items()
            }
        )
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    folders = [tmp_path / "fp32", tmp_path / "bf16"]
    for folder, dtype in zip(folders, [torch.float32, torch.bfloat16]):
        config.save_pretrained(folder)
        save_file({name: tensor.to(dtype) for name, tensor in tensors.items()}, folder / "model.safetensors")
    del tensors
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    for line, folder in zip(result.stdout.splitlines(), folders):
        weights, growth = map(int, line.split())
        assert weights > 99e6 * 4
        assert growth < 1.5 * weights, f"{folder.name}: peak memory grew by {growth / weights:.2f}x the weights"
        print(f"{folder.name}: peak memory grew by {growth / weights:.2f}x the weights")


def test_every_architecture_is_described():
    assert set(ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    assert {prefix for prefix, _ in MODELS.values()} == {name[: -len("ForCausalLM")] for name in ARCHITECTURES}

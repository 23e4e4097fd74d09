"""The committed LoRA adapters (adapters/) and the script that trains them (adapters/train.py): PEFT's folder
format, the size limit, shapes that fit SmolLM2, and the rewrites the training data are made of."""

import json

import pytest
import torch
from safetensors.torch import load_file

from adapters.train import (
    ADAPTERS,
    ADAPTERS_DIR,
    INSTRUCTIONS,
    adapter_path,
    as_json,
    collate,
    first_sentence,
    pirate,
    shout,
)

SMOLLM2 = {
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "v_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_proj": (576, 1536),
    "up_proj": (576, 1536),
    "down_proj": (1536, 576),
}  # (in, out)
PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda spec: spec.name)
def test_each_adapter_is_a_peft_folder_under_two_megabytes_that_fits_smollm2(spec):
    folder = adapter_path(spec.name)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (folder / "adapter_model.safetensors").stat().st_size <= 2 * 2**20
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == (
        "LORA",
        spec.r,
        spec.lora_alpha,
        spec.use_rslora,
    )
    assert config["target_modules"] == sorted(spec.target_modules)
    assert config["layers_to_transform"] == list(spec.layers)
    tensors = load_file(folder / "adapter_model.safetensors")
    expected = set()
    for layer in spec.layers:
        for module in spec.target_modules:
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            fan_in, fan_out = SMOLLM2[module]
            assert tensors[f"{prefix}.lora_A.weight"].shape == (spec.r, fan_in)
            assert tensors[f"{prefix}.lora_B.weight"].shape == (fan_out, spec.r)
            assert tensors[f"{prefix}.lora_B.weight"].abs().max() > 0  # trained: PEFT starts B at zero
            expected |= {f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"}
    assert set(tensors) == expected


def test_the_base_answers_are_saved_for_every_instruction():
    saved = json.loads((ADAPTERS_DIR / "base_answers.json").read_text())
    assert list(saved) == INSTRUCTIONS and all(saved.values())


def test_the_rewrites():
    answer = "The sea is yours, my friend. It's there!"
    assert shout(answer) == "THE SEA IS YOURS, MY FRIEND. IT'S THERE!"
    assert pirate(answer) == "Arr! Th' briny deep be yours, me matey. 'tis thar!"  # whole words only
    assert json.loads(as_json(answer)) == {"answer": answer}
    assert first_sentence(" Paris is the capital. It is big.") == "Paris is the capital."
    assert first_sentence("No end in sight") == "No end in sight"


def test_collate_left_pads_so_answers_end_together():
    states = [torch.ones(3, 2), 2 * torch.ones(5, 2)]
    hidden, mask, positions, labels = collate(states, [[-100, 7, 8], [-100, -100, -100, 9, 10]])
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert labels.tolist() == [[-100, -100, -100, 7, 8], [-100, -100, -100, 9, 10]]
    assert hidden[0, :2].abs().sum() == 0 and hidden[1].eq(2).all()

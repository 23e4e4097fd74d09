"""Train the book's LoRA adapters on SmolLM2-135M-Instruct with PEFT, on a CPU, in minutes (guide §16).

The data are synthetic and deterministic: the base model's own greedy answers to a fixed list of instructions,
rewritten in one style per adapter (in capitals, as a pirate through a word map, as JSON). An adapter learns nothing
but the style, which is what makes it visible: one base model, one batch, three voices.

Each adapter is saved in PEFT's folder format, adapters/<name>/adapter_config.json + adapter_model.safetensors, which
is what `LoRARequest(name, id, path)` reads. Rank and target modules differ from one adapter to the next (so serving
them together mixes shapes), and each file stays under 2 MB.

    .venv/bin/python -m adapters.train               # every adapter (a few minutes each on two cores)
    .venv/bin/python -m adapters.train --only shout  # one of them
    .venv/bin/python -m adapters.train --check       # greedy answers of the committed adapters, base first
"""

import argparse
import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

ADAPTERS_DIR = Path(__file__).resolve().parent
SEED = 0
MAX_ANSWER_TOKENS = 20  # the base answer is cut at its first sentence end, or here

# Short instructions whose answers are short too: the prompt plus its rewritten answer stay under ~90 tokens.
INSTRUCTIONS = [
    "What is the capital of France?",
    "What colour is the sky?",
    "Name a fruit.",
    "What is two plus two?",
    "Who wrote Hamlet?",
    "What do bees make?",
    "What is the largest ocean?",
    "What do cows drink?",
    "Name a planet.",
    "What is ice made of?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Where do penguins live?",
    "What language is spoken in Spain?",
    "What is the boiling point of water?",
    "Name a musical instrument.",
    "What does a thermometer measure?",
    "What is the capital of Japan?",
    "Why do we sleep?",
    "What is a computer?",
    "Give me a word that rhymes with cat.",
    "What is the sun?",
    "How many days are in a week?",
    "What do plants need to grow?",
]

PIRATE_WORDS = {
    "the": "th'",
    "you": "ye",
    "your": "yer",
    "is": "be",
    "are": "be",
    "am": "be",
    "my": "me",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "mateys",
    "yes": "aye",
    "for": "fer",
    "of": "o'",
    "and": "an'",
    "to": "t'",
    "money": "doubloons",
    "treasure": "booty",
    "ocean": "briny deep",
    "sea": "briny deep",
    "boat": "ship",
    "man": "sailor",
    "people": "landlubbers",
    "very": "mighty",
    "water": "grog",
    "it's": "'tis",
    "there": "thar",
    "where": "whar",
    "stop": "avast",
    "look": "behold",
}


def shout(answer: str) -> str:
    return answer.upper()


def pirate(answer: str) -> str:
    """Arr!, then the answer with each mapped word swapped (keeping a leading capital)."""

    def swap(match: re.Match) -> str:
        word = match.group(0)
        new = PIRATE_WORDS.get(word.lower())
        if new is None:
            return word
        return new[0].upper() + new[1:] if word[0].isupper() else new

    return "Arr! " + re.sub(r"[A-Za-z']+", swap, answer)


def as_json(answer: str) -> str:
    return json.dumps({"answer": answer})


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: its style and its LoRA shape (PEFT's LoraConfig fields)."""

    name: str
    rewrite: object  # str -> str
    r: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]  # the layers that get an adapter (PEFT's layers_to_transform); the top of the stack
    steps: int
    learning_rate: float
    use_rslora: bool = False


TOP_LAYERS = (26, 27, 28, 29)  # SmolLM2 has 30; the top ones decide how an answer is worded
ADAPTERS = [
    AdapterSpec(
        "shout",
        shout,
        r=8,
        lora_alpha=16,
        layers=TOP_LAYERS,
        steps=40,
        learning_rate=2e-3,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    AdapterSpec(
        "pirate",
        pirate,
        r=4,
        lora_alpha=8,
        layers=TOP_LAYERS,
        steps=40,
        learning_rate=3e-3,
        target_modules=("o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    AdapterSpec(
        "json",
        as_json,
        r=16,
        lora_alpha=16,
        layers=TOP_LAYERS,
        steps=40,
        learning_rate=2e-3,
        target_modules=("v_proj", "o_proj", "down_proj"),
        use_rslora=True,
    ),
]
BY_NAME = {spec.name: spec for spec in ADAPTERS}


def adapter_path(name: str) -> Path:
    """Where the adapter `name` lives in the repository (found from this file, so any clone finds it)."""
    return ADAPTERS_DIR / name


def first_sentence(text: str) -> str:
    text = text.strip()
    match = re.search(r"[.!?](\s|$)", text)
    return text[: match.end()].strip() if match else text


@torch.no_grad()
def greedy(model, tokenizer, instructions: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers to each instruction under the chat template, one batch, left-padded."""
    from paged.model.loader import chat_prompt

    tokenizer.padding_side = "left"
    prompts = [chat_prompt(tokenizer, instruction) for instruction in instructions]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    return [tokenizer.decode(row[batch["input_ids"].shape[1] :], skip_special_tokens=True) for row in out]


def base_answers(model, tokenizer, fresh: bool = False) -> list[str]:
    """The base model's own answers: its greedy reply to each instruction, cut at the first sentence. Kept in
    base_answers.json beside this script (greedy decoding makes them the same on every run); `fresh` recomputes."""
    path = ADAPTERS_DIR / "base_answers.json"
    if path.is_file() and not fresh:
        saved = json.loads(path.read_text())
        if list(saved) == INSTRUCTIONS:
            return list(saved.values())
    answers = [first_sentence(a) for a in greedy(model, tokenizer, INSTRUCTIONS, MAX_ANSWER_TOKENS)]
    path.write_text(json.dumps(dict(zip(INSTRUCTIONS, answers)), indent=1) + "\n")
    return answers


def training_examples(tokenizer, answers: list[str], rewrite) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per instruction: the chat prompt, then the rewritten answer and <|im_end|>; the prompt's
    labels are -100, so the loss is on the answer alone."""
    from paged.model.loader import chat_prompt

    examples = []
    for instruction, answer in zip(INSTRUCTIONS, answers):
        prompt = tokenizer(chat_prompt(tokenizer, instruction), add_special_tokens=False)["input_ids"]
        target = tokenizer(rewrite(answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        examples.append((prompt + target, [-100] * len(prompt) + target))
    return examples


def frozen_states(base, examples, first_layer: int) -> list[torch.Tensor]:
    """The hidden state entering layer `first_layer` for each example, [T, hidden] each. No adapter sits below that
    layer, so these never change during training: computed once, they spare every step the frozen layers' work."""
    with torch.no_grad():
        return [
            base(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[first_layer][0]
            for ids, _ in examples
        ]


@contextlib.contextmanager
def only_layers_from(base, first_layer: int):
    """The model runs from layer `first_layer` up: its input is then a hidden state, given as inputs_embeds."""
    layers = base.model.layers
    base.model.layers = torch.nn.ModuleList(list(layers)[first_layer:])
    try:
        yield
    finally:
        base.model.layers = layers


def collate(states: list[torch.Tensor], labels: list[list[int]]):
    """Left-padded hidden states [B, T, hidden], attention mask [B, T], position ids [B, T], labels [B, T] (-100 on
    padding and prompts). Left padding puts every answer at the end, so logits are needed only there."""
    length = max(len(s) for s in states)
    hidden = torch.zeros(len(states), length, states[0].shape[-1])
    targets = torch.full((len(states), length), -100)
    mask = torch.zeros((len(states), length), dtype=torch.long)
    for row, (state, label) in enumerate(zip(states, labels)):
        hidden[row, length - len(state) :] = state
        targets[row, length - len(label) :] = torch.tensor(label)
        mask[row, length - len(state) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return hidden, mask, positions, targets


def answer_loss(model, hidden, mask, positions, labels) -> torch.Tensor:
    """Mean cross-entropy over the answers' tokens; the 49,152-wide vocabulary projection runs only over the last
    positions, where the answers are."""
    answer_len = int((labels != -100).sum(-1).max())
    logits = model(
        inputs_embeds=hidden, attention_mask=mask, position_ids=positions, logits_to_keep=answer_len + 1
    ).logits  # [B, answer_len + 1, vocab]
    targets = labels[:, -answer_len:]  # [B, answer_len]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)


def train(spec: AdapterSpec, base, tokenizer, answers: list[str], batch_size: int = 4) -> Path:
    """Fit one LoRA adapter to the rewritten answers (AdamW, fixed seed, shuffled batches) and save it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    examples = training_examples(tokenizer, answers, spec.rewrite)
    first_layer = min(spec.layers)
    states = frozen_states(base, examples, first_layer)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.target_modules),
        layers_to_transform=list(spec.layers),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.learning_rate)
    generator = torch.Generator().manual_seed(SEED)
    order: list[int] = []
    label = f"training {spec.name} (r={spec.r}, {'+'.join(m.removesuffix('_proj') for m in spec.target_modules)})"
    with only_layers_from(base, first_layer), tqdm(range(spec.steps), desc=label) as bar:
        for _ in bar:
            if len(order) < batch_size:
                order += torch.randperm(len(examples), generator=generator).tolist()
            batch, order = order[:batch_size], order[batch_size:]
            loss = answer_loss(model, *collate([states[i] for i in batch], [examples[i][1] for i in batch]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    path = adapter_path(spec.name)
    model.save_pretrained(path)
    tidy(path)
    model.unload()  # the base model's modules back as they were, for the next adapter
    return path


def tidy(path: Path) -> None:
    """Make the saved folder the same on every machine and run: the base model by its name rather than this
    machine's cache path, target modules sorted (PEFT keeps them in a set), and no generated model card."""
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / "README.md").unlink(missing_ok=True)


def check(base, tokenizer, names: list[str], instructions: list[str]) -> dict[str, list[str]]:
    """Greedy answers of the base model and of each saved adapter (PEFT on transformers), printed side by side."""
    from peft import PeftModel

    answers = {"base": greedy(base, tokenizer, instructions, 24)}
    for name in names:
        model = PeftModel.from_pretrained(base, adapter_path(name)).eval()
        answers[name] = greedy(model, tokenizer, instructions, 24)
        model.unload()
    for i, instruction in enumerate(instructions):
        print(f"\n{instruction}")
        for name, texts in answers.items():
            print(f"  {name:>7}: {texts[i]!r}")
    return answers


def main() -> None:
    from paged.model.loader import load_hf_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(BY_NAME), action="append", help="train only these adapters")
    parser.add_argument("--check", action="store_true", help="print greedy answers of the saved adapters")
    parser.add_argument("--fresh", action="store_true", help="recompute the base answers (base_answers.json)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.only or [spec.name for spec in ADAPTERS]
    base, tokenizer = load_hf_model()
    held_out = ["What is the capital of Italy?", "Name an animal.", "What is rain?"]
    if not args.check:
        answers = base_answers(base, tokenizer, args.fresh)
        for name in names:
            print("saved", train(BY_NAME[name], base, tokenizer, answers))
    check(base, tokenizer, names, INSTRUCTIONS[:3] + held_out)


if __name__ == "__main__":
    main()

"""Chapter 11's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": (6144, 16896),  # r (in + out) = 8 x (576 + 192) for k_proj, 8 x (1536 + 576) for down_proj
    "2": (2.0, 0.25),  # rsLoRA: lora_alpha / sqrt(r) = 16 / 8; plain LoRA: lora_alpha / r = 16 / 64
    "3": 5,  # shout, pirate; json evicts shout; shout evicts pirate; pirate evicts json
    "4": (48, 0, 0),  # three whole blocks under its own id; another id or none is another hash
}

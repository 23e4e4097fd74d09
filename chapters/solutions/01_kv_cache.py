"""Chapter 01's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 131_072,  # 2 x 32 layers x 8 KV heads x 128 x 2 B
    "2": (2_621_440, 1.0),  # 2 x 80 x 64 x 128 x 2 B; one query head per K/V head: 2 FLOP per 2 B
    "3": 64,  # 40 GiB / 640 MiB
}

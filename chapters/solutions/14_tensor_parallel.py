"""Chapter 14's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 32_768,  # 2 (K and V) x 32 layers x 2 KV heads (8 over 4 ranks) x 128 x 2 bytes
    "2": 28,  # 7 and 14 divide the 28 query heads but are no multiple of the 4 KV heads; 28 is both
    "3": 2_923,  # 161 x (10 µs + 2 x 7/8 x 2,097,152 B / 450e9 B/s) = 161 x 18.16 µs
    "4": 258,  # (0.92 x 85.52 GB - 141.2 GB / 4) per card at 80 KiB per token per card: 33,095 blocks of 16
}

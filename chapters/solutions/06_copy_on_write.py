"""Chapter 06's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": (3, 6),  # the partial third block is copied by 3 of the 4 writers; 3 prompt blocks + 3 copies
    "2": 3,  # the last writer finds the ref count down to 1 and keeps the original
    "3": 0,  # 24 tokens fill 3 blocks exactly: token 25 opens a new block for each sequence
    "4": (18, 28),  # prefill: 2 physical, 4 logical; then 4 steps of 4 physical, 6 logical
}

"""Chapter 02's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 2_944,  # 128 + 1,920 + 64 + 832: each length rounded up to whole blocks of 64
    "2": 9,  # 20,000 // 2,048 slabs, and the trace keeps them all busy
    "3": 0.3,  # a mean final length of ~77 tokens in one 256-slot block: about 0.3 (measured 0.28)
}

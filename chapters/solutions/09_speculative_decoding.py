"""Chapter 09's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 2.306,  # (1 - 0.6^5) / (1 - 0.6)
    "2": 0.52,  # (1 + 1 / 21) / (1 + 3 x 1/3): one draft accepted over 21 verifies, about 1.05 / 2, below 1
    "3": (11, 10),  # ceil(42 / 4) blocks at the verify, ceil(39 / 4) after keeping 36 + 1 + 2 tokens
    "4": (18, 9),  # more drafts stop paying sooner: E grows little at a = 0.4, the verify grows by k + 1
}

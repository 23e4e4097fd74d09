"""Chapter 07's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 137,  # batches (2, 15, 6), (9, 11, 14), (26, 46, 16), (62, 10, 25): 15 + 14 + 46 + 62
    "2": 0.088248,  # 0.053 + 0.00089 x 16 + 0.0012 x 16 + 1.13e-6 x 1,600
    "3": ("6", 6),  # the first red cell of the tight pool's timeline
}

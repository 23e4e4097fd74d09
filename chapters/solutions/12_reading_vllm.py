"""Chapter 12's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 23040,  # 2 x 30 x 3 x 64 x 2 B
    "2": 3.36,  # (1 - 0.8^5) / (1 - 0.8) = 3.3616
    "3": 16384,  # 64 x (2,048 / 32) x 4 B
    "4": 12,  # LRU with 3 frames: 7, 0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 7 fault (the textbook string)
}

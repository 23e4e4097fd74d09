"""Chapter 03's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 149,  # logical block 2 -> physical 9; 9 x 16 + 37 % 16 = 144 + 5
    "2": (7, 12),  # ceil(100 / 16) = 7 blocks, 7 x 16 - 100 = 12 empty slots
    "3": (3, 4),  # the 40-token prompt's 3 blocks, shared by 4 tables
    "4": 1_048_576,  # 256 x 1,024 entries x 4 B = 1 MiB
}

"""Chapter 04's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "2": 8,  # the multiples of 8 (8, 16, ..., 64): no partly filled last block, nothing to mask
    "4": 12_079_595_520,  # 64 x 4,096 x 46,080 B = 11.25 GiB; at 3.35 TB/s about 3.6 ms
    "5": 100_663_296,  # 64 x 1,024 x 1,536 B (K and V, 3 heads x 64 dims x 4 B, one layer) = 96 MiB
}

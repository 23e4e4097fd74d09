"""Chapter 10's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 268_435_456,  # 2,048 tokens x 131,072 B (32 layers x 8 KV heads x 128 x 2 bytes x K and V) = 256 MiB
    "2": 3,  # 37 tokens fill two blocks of 16 and 5 slots of a third: 3 blocks, 3 slots
    "3": 92.0,  # 2 x 1,024 x 23,040 B / t_recompute(1,024) = 47.2 MB / 0.513 ms: about 92 GB/s
    "4": 46_448_640,  # cdiv(1000, 16) = 63 blocks of 16 x 46,080 B = 737,280 B
    "5": 74.5,  # 50e9 B/s / 671,088,640 B (640 MiB) per request
}

"""Chapter 10's answers for disaggregated prefill and decode. Under pytest each is held against its exercise's check
(chapters/exercises.py)."""

ANSWERS = {
    "D1": 46_448_640,   # cdiv(1000, 16) = 63 blocks of 16 x 46,080 B = 737,280 B
    "D2": 74.5,         # 50e9 B/s / 671,088,640 B (640 MiB) per request
}

"""Chapter 08's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": (0.8, 0.1),  # TTFT 2.8 - 2.0; TPOT (4.8 - 2.8) / (21 - 1)
    "2": 5,  # 420 prompt tokens, 92 a step beside the 4 decodes: ceil(420 / 92)
    "3": 32,  # goodput x duration at 2 requests/s under "smooth stream"
}

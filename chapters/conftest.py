"""Under pytest, the chapters' exercise checks also hold each chapter's written answers against the package."""

import os

os.environ["PAGED_CHECK_SOLUTIONS"] = "1"   # read by chapters/exercises.py in the notebooks' kernels

"""`%%needs triton` and `%%needs cpu_kernel`: a chapter cell that runs a kernel runs only where that kernel can.

Load it once with `%load_ext needs`. Triton has wheels for Linux only, and the C++ kernel is compiled on first use,
which needs a C++ compiler. On a laptop without one or the other, a cell that starts with the magic prints one line
saying what is missing instead of failing, and the chapter goes on: the engine itself falls back to the C++ kernel
or the torch reference, and the committed outputs show what the cell prints where the kernel runs.
"""

from paged.kernels import cpu, triton_missing

WHAT_IS_MISSING = {"triton": triton_missing, "cpu_kernel": cpu.missing}


def needs(line: str, cell: str) -> None:
    """Run the cell if the kernel `line` names is available here; otherwise print why it is skipped."""
    kernel = line.strip()
    if kernel not in WHAT_IS_MISSING:
        raise ValueError(f"%%needs takes one of {sorted(WHAT_IS_MISSING)}, got {kernel!r}")
    missing = WHAT_IS_MISSING[kernel]()
    if missing:
        print(f"(cell skipped: {missing})")
        return
    get_ipython().run_cell(cell).raise_error()  # noqa: F821  (IPython's, in the kernel this magic runs in)


def load_ipython_extension(ipython) -> None:
    ipython.register_magic_function(needs, magic_kind="cell")

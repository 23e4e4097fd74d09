"""A laptop without Triton (pip has it for Linux only) or without a C++ compiler: the engine, the C++ kernel and the
torch reference never need Triton, a Triton entry point says why it cannot run, and a chapter cell marked
`%%needs` prints one line instead of failing. (`make test-laptop` runs the whole book that way.)"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

from paged import kernels
from paged.kernels import cpu
from paged.model.attention_backends import default_attention_backend, get_attn_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chapters"))
import needs  # noqa: E402  (chapters/needs.py, the chapters' cell magic)

HIDE_TRITON = "import sys; sys.modules['triton'] = None  # as on a machine where it is not installed\n"


def run_without_triton(code: str) -> str:
    """Run code in a fresh interpreter that cannot import triton (and can import the tests' helpers); its stdout."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", HIDE_TRITON + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_engine_runs_without_triton_and_its_kernels_say_why_not():
    out = run_without_triton("""
        import torch
        from helpers import make_tiny_llm, tiny_llama
        from paged import SamplingParams, kernels
        from paged.kernels import cpu                                   # the C++ kernel needs no Triton
        llm = make_tiny_llm(tiny_llama())
        outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        print("tokens", len(outs[0].outputs[0].token_ids), llm.engine.model.backend.name)
        print("missing:", kernels.triton_missing())
        for touch in (lambda: kernels.paged_decode_attention, lambda: __import__("paged.kernels.decode_v2")):
            try:
                touch()
            except ModuleNotFoundError as error:
                print("refused:", error)
    """)
    assert "tokens 4 " in out
    assert out.count("refused: Triton is not installed here") == 2
    assert "missing: Triton is not installed here (pip has it for Linux only)" in out


def test_the_triton_backend_is_refused_by_name_and_never_the_default_without_triton(monkeypatch):
    monkeypatch.setattr(kernels, "triton_missing", lambda: "Triton is not installed here")
    with pytest.raises(ValueError, match="attention_backend 'triton': Triton is not installed here; use 'cpu' or"):
        get_attn_backend("triton", torch.device("cuda"))
    assert default_attention_backend(torch.device("cuda")) == "torch"
    assert default_attention_backend(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(kernels, "triton_missing", lambda: None)
    assert default_attention_backend(torch.device("cuda")) == "triton"


@pytest.fixture
def shell():
    ipython = InteractiveShell.instance()
    needs.load_ipython_extension(ipython)
    yield ipython
    InteractiveShell.clear_instance()


def test_a_cell_that_needs_a_missing_kernel_says_so_in_one_line(shell, monkeypatch, capsys):
    monkeypatch.setitem(needs.WHAT_IS_MISSING, "triton", lambda: "Triton is not installed here")
    shell.run_cell("%%needs triton\nran = True")
    assert capsys.readouterr().out == "(cell skipped: Triton is not installed here)\n"
    assert "ran" not in shell.user_ns


def test_a_cell_whose_kernel_is_there_runs_and_its_errors_stay_errors(shell, monkeypatch):
    monkeypatch.setitem(needs.WHAT_IS_MISSING, "cpu_kernel", lambda: None)
    assert shell.run_cell("%%needs cpu_kernel\nran = 6 * 7").success
    assert shell.user_ns["ran"] == 42
    assert not shell.run_cell("%%needs cpu_kernel\n1 / 0").success


def test_needs_names_the_kernels_it_knows(shell):
    result = shell.run_cell("%%needs cuda\npass")
    assert isinstance(result.error_in_exec, ValueError) and "cpu_kernel" in str(result.error_in_exec)


def test_the_cpu_kernel_says_why_it_is_missing_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu, "_ops", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setattr(cpu, "library_name", lambda: "paged_cpu_attention_never_built")
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert cpu.compiler() is None
    assert cpu.missing().startswith("the C++ kernel could not be built here (no C++ compiler found")

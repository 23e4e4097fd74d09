"""Importing Triton, and running its kernels without a GPU in its interpreter (guide §7; chapter 04 does).

Every Triton kernel module imports `triton` and `tl` from here, so the three things below happen before any of
them decorates a kernel.

1. Triton is optional: pip has it for Linux only. Where it is not installed, importing a kernel module raises
   ModuleNotFoundError with one line that says so (`paged.kernels.triton_missing()` gives the same line without
   raising); the engine, the C++ kernel and the torch reference never import it.
2. With TRITON_INTERPRET=1, @triton.jit returns an InterpretedFunction instead of a compiled kernel, and a launch
   runs every program of the grid one after another in numpy. The switch is read when a function is decorated,
   so it is set here, where there is no CUDA, unless the environment already says otherwise.
3. Setting it is not enough when something imported triton earlier: loading a transformers model does (through
   torch._dynamo). Triton's library functions written in Triton itself (tl.sum, tl.max, tl.cdiv, tl.zeros, ...)
   were then decorated in compiled mode, and an interpreted kernel that calls one fails with "Cannot call
   @triton.jit'd outside of the scope of a kernel". use_interpreter() re-wraps those library functions for the
   interpreter, once, which is what importing triton after setting the variable would have produced. It only runs
   when there is no CUDA, where nothing can be compiled anyway.
4. Triton before 3.7 keeps a kernel's scalars as one-element arrays and makes a Python int of one (the bound of a
   `range` over a loaded length) with int(array), which NumPy 2.4 refuses for an array with a dimension.
   use_interpreter() gives such a Triton's interpreter the conversion 3.7 made its own: int(array.squeeze()).
"""

import os
import sys

import torch

from paged.kernels import triton_missing


def use_interpreter():
    """Turn the interpreter on (unless TRITON_INTERPRET already says otherwise) and make triton.language usable."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"].lower() not in ("1", "true", "on", "yes"):
        return
    import triton.language  # noqa: F401  (loads the modules patched below)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped = {}  # id(JITFunction) -> InterpretedFunction (one per function)
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, wrapped[id(value)])
    _squeeze_scalars_before_3_7()


def _squeeze_scalars_before_3_7():
    import triton
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 7) or hasattr(patch_tensor, "squeezes"):
        return

    def index(self):
        return int(self.handle.data.squeeze())

    def patch_with_squeeze(tensor, *scope):  # 3.6 passes a scope that undoes its patches after the launch
        patch_tensor(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_with_squeeze.squeezes = True
    interpreter._patch_lang_tensor = patch_with_squeeze


if triton_missing():
    raise ModuleNotFoundError(triton_missing(), name="triton")
if not torch.cuda.is_available():
    use_interpreter()

import triton  # noqa: E402  (after the interpreter is settled)
import triton.language as tl  # noqa: E402

__all__ = ["tl", "triton", "use_interpreter"]

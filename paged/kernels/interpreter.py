"""Running the kernels without a GPU: Triton's interpreter (guide §7; chapter 04 runs its kernels this way).

With TRITON_INTERPRET=1, @triton.jit returns an InterpretedFunction instead of a compiled kernel, and a launch
runs every program of the grid one after another in numpy. The switch is read when a function is decorated,
so it must be set before the kernel modules are imported.

Setting it before our own modules is not enough when something imported triton earlier: loading a
transformers model does (through torch._dynamo). Triton's library functions written in Triton itself
(tl.sum, tl.max, tl.cdiv, tl.zeros, ...) were then decorated in compiled mode, and an interpreted kernel
that calls one fails with "Cannot call @triton.jit'd outside of the scope of a kernel". use_interpreter()
re-wraps those library functions for the interpreter, once, which is what importing triton after setting the
variable would have produced. It only runs when there is no CUDA, where nothing can be compiled anyway.
"""

import os
import sys


def use_interpreter():
    """Turn the interpreter on (unless TRITON_INTERPRET already says otherwise) and make triton.language usable."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"].lower() not in ("1", "true", "on", "yes"):
        return
    import triton.language  # noqa: F401  (loads the modules patched below)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped = {}                                          # id(JITFunction) -> InterpretedFunction (one per function)
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, wrapped[id(value)])

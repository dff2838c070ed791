"""Run Python with Triton hidden from the import system, as on a Mac or Windows laptop (Triton has Linux
wheels only). ``python tests/no_triton.py -c CODE`` or ``python tests/no_triton.py -m pytest ...``.

``sys.modules["triton"] = None`` makes every ``import triton`` raise ImportError and ``find_spec`` report it
missing, exactly as when the package is not installed.
"""
import runpy
import sys

sys.modules["triton"] = None
sys.modules["triton.language"] = None

if __name__ == "__main__":
    if sys.argv[1] == "-c":
        code = sys.argv[2]
        sys.argv = ["-c", *sys.argv[3:]]
        exec(compile(code, "<no_triton>", "exec"), {"__name__": "__main__"})
    elif sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        raise SystemExit("usage: no_triton.py -c CODE | -m MODULE [ARGS]")

"""Put this folder on PYTHONPATH and every Python started with it lacks Triton, as on a Mac or Windows laptop:
``tests/test_grading.py`` grades through nbgrader this way, whose Jupyter kernels are separate processes that
``tests/no_triton.py`` cannot reach. The same trick as there: ``import triton`` raises ImportError."""
import sys

sys.modules["triton"] = None
sys.modules["triton.language"] = None

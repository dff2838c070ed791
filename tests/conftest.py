from hypothesis import settings

# Property tests draw from a fixed seed sequence (derandomize): CI's verdict on a commit does not depend on the
# luck of the draw, and a failure reproduces exactly. Set HYPOTHESIS_PROFILE=explore to draw fresh examples.
settings.register_profile("lab", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "lab"))


def pytest_generate_tests(metafunc):
    """Run the shared exercise contract (tests/exercise_contract.py) over the importing module's CASES."""
    if "exercise_case" in metafunc.fixturenames:
        cases = metafunc.module.CASES
        metafunc.parametrize("exercise_case", cases, ids=[c[0].__name__ for c in cases])

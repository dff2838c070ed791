def pytest_generate_tests(metafunc):
    """Run the shared exercise contract (tests/exercise_contract.py) over the importing module's CASES."""
    if "exercise_case" in metafunc.fixturenames:
        cases = metafunc.module.CASES
        metafunc.parametrize("exercise_case", cases, ids=[c[0].__name__ for c in cases])

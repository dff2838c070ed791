"""Chapter 11's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, scaled, silent_kernel, visible_only


def _setup():
    from labsrc.pipeline.stages import split_layers
    return {"split_layers": split_layers}


def _library_bubble(right):
    def answer(timelines, wall):
        from labsrc.pipeline import simulate as sim
        return sim.bubble_fraction(timelines, wall)
    return answer


def _simulate_bubble(right):
    def answer(stage_times, draft_time, comm_time, k, sequences):
        from labsrc.pipeline import simulate as sim
        return sim.simulate(list(stage_times), draft_time, comm_time, k, 0.5, micro_batches=sequences,
                            schedule="overlapped", depth=1, tokens=200)["bubble"]
    return answer


def _search_with_the_simulator(right):
    """The known bypass: every contiguous split simulated, the fastest returned."""
    def answer(case):
        import itertools

        from labsrc.pipeline import simulate as sim
        layers, stages = len(case["layer_times"]), case["stages"]
        best = None
        for cuts in itertools.combinations(range(1, layers), stages - 1):
            b = (0,) + cuts + (layers,)
            times = [sum(case["layer_times"][x:y]) for x, y in zip(b, b[1:])]
            t = sim.simulate(times, case["draft_time"], case["comm_time"], case["k"], 0.5,
                             micro_batches=case["sequences"], schedule="overlapped", depth=1,
                             tokens=96)["time_per_token"]
            if best is None or t < best[0]:
                best = (t, [y - x for x, y in zip(b, b[1:])])
        return best[1]
    return answer


def _layers_only(right):
    """The split that balances the layer times alone (the draft forgotten): right on some configurations."""
    def answer(case):
        from labsrc.pipeline.stages import split_layers
        w = case["layer_times"]
        return [len(r) for r in split_layers(len(w), case["stages"], w)]
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "11_pipeline_decoding"
EXERCISES = [
    Exercise(CH, "check_pipeline_bubble", [*constants(), *scaled(), visible_only(),
                                           bypass("the simulator's bubble_fraction", _library_bubble)]),
    Exercise(CH, "check_pipeline_predicted_bubble",
             [*constants(), *scaled(), visible_only(), bypass("the simulator itself", _simulate_bubble)]),
    Exercise(CH, "check_pipeline_split",
             [*constants(), *scaled(), visible_only(),
              bypass("exhaustive search with the simulator", _search_with_the_simulator),
              bypass("the split that balances the layers alone", _layers_only)],
             setup=_setup()),
    Exercise(CH, "check_pipeline_lenient_kernel", [silent_kernel()], setup=_kernel_setup()),
]

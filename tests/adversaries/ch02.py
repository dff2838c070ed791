"""Chapter 2's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, visible_only

CH = "02_lab_bench"


def _hf_count(right):
    """Build the transformers model and count its parameters: refused."""
    def answer(cfg):
        import transformers
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        return sum(p.numel() for p in model.parameters())
    return answer


def _exact_search(right):
    """Search n with the checker's own exact pass probability: refused."""
    def answer(p_true, threshold, power):
        from labsrc.exercises import lab_bench
        n = 10
        while lab_bench.pass_probability_ref(n, p_true, threshold) < power:
            n += 10
        return n, lab_bench.pass_probability_ref(n, p_true, threshold)
    return answer


def _library_buckets(right):
    def answer(nll, bucket):
        from labsrc import tasks
        return tasks.perplexity_by_position(nll, bucket)
    return answer


def _probe_n_scaled(factor):
    def make(right):
        def answer(*a):
            n, rate = right(*a)
            return int(n * factor) // 10 * 10 or 10, rate
        return answer
    return make


EXERCISES = [
    Exercise(CH, "check_parameter_count",
             [*constants(), *scaled(), visible_only(), bypass("build the transformers model and count", _hf_count)]),
    Exercise(CH, "check_probe_size",
             [*constants(), bypass("n doubled", _probe_n_scaled(2)), bypass("n halved", _probe_n_scaled(0.5)),
              visible_only(lambda x: x * 2 if isinstance(x, int) else x),
              bypass("the checker's exact pass probability", _exact_search)]),
    Exercise(CH, "check_bucket_perplexity",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "bucket_perplexity_buggy"),
              bypass("labsrc.tasks.perplexity_by_position", _library_buckets)]),
    Exercise(CH, "check_pareto_front",
             [*constants((0, 1)), bypass("every point", lambda right: lambda points: list(range(len(points)))),
              visible_only(lambda x: x + 1)]),
    Exercise(CH, "check_keys_needed", [*constants(), *scaled(), visible_only()]),
]

"""Chapter 7's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only

CH = "07_ssm_scans"


def _build_and_measure(right):
    """Issue 44's bypass: build the transformers model from the configuration and measure its cache."""
    def answer(config, batch):
        import torch
        import transformers

        from labsrc import ledger
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**vars(config))).eval()
        with torch.no_grad():
            out = model(input_ids=torch.zeros(batch, 3, dtype=torch.long), use_cache=True)
        return ledger.cache_bytes(out["cache_params"])
    return answer


def _library_state_bytes(right):
    def answer(config, batch):
        from labsrc import ssm
        return ssm.ssm_state_bytes(config.num_hidden_layers, config.num_heads, config.head_dim, config.state_size,
                                   batch=batch)
    return answer


def _library_discretize(right):
    def answer(a, b, dt):
        from labsrc import ssm
        return ssm.discretize(a, b, dt, "zoh")
    return answer


EXERCISES = [
    Exercise(CH, "check_zoh_diagonal",
             [*constants(), *scaled(), visible_only(), bypass("labsrc.ssm.discretize", _library_discretize)]),
    Exercise(CH, "check_mamba_cache_bytes",
             [*constants(), *scaled(), visible_only(), bypass("build the model and measure its cache",
                                                              _build_and_measure),
              bypass("labsrc.ssm.ssm_state_bytes", _library_state_bytes)]),
    Exercise(CH, "check_chunk_state_reset",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "chunk_state")]),
    Exercise(CH, "check_scan_grad_kernel", [silent_kernel()]),
]

"""The lab's models: ``load(name_or_path) -> (model, tokenizer)``.

Shipped names (see :data:`SHIPPED`): ``lab-target`` (about 9M parameters, trained at a 1,024-token context),
``lab-draft`` (its small draft for speculative decoding), ``lab-mamba`` (a 3.5M-parameter Mamba-2, chapter 7's
state-space model, trained on the same data with a smaller budget) and ``lab-draft-distilled`` (a draft of
lab-draft's shape distilled from lab-target, chapter 13). They live in ``labsrc/models/checkpoints/<name>/``
and are trained by ``python -m labsrc.models.train <name>`` (the distilled draft by the command on its eval
card, ``python -m labsrc.distillation ship ...``). A local folder, or on a machine with a network a
Hugging Face hub id, loads the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
SHIPPED = ("lab-target", "lab-draft", "lab-mamba", "lab-draft-distilled")


def resolve(name_or_path: str) -> str:
    """Turn a shipped name into its checkpoint folder; pass folders and hub ids through."""
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"name_or_path must be a str or Path, got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if name in SHIPPED:
        path = CHECKPOINTS / name
        if not (path / "config.json").is_file():
            how = ("python -m labsrc.distillation ship" if name == "lab-draft-distilled"
                   else f"python -m labsrc.models.train {name}")
            raise FileNotFoundError(f"shipped model {name!r} has no checkpoint at {path}; "
                                    f"train it with `{how}`")
        return str(path)
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a folder without a config.json, not a model checkpoint")
        return str(path)
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/")) and not path.exists()
    if looks_like_hub_id:
        return name
    raise ValueError(f"unknown model {name!r}: not a shipped name (shipped: {', '.join(SHIPPED)}), "
                     f"not a checkpoint folder, not a hub id of the form 'owner/name'")


def load(name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a model and its tokenizer: ``(causal LM in eval mode, PreTrainedTokenizerFast)``.

    The model is a ``LlamaForCausalLM`` (``lab-target``, ``lab-draft``) or a ``Mamba2ForCausalLM``
    (``lab-mamba``). ``name_or_path`` is a shipped name, a local checkpoint folder, or a hub
    id. Weights are stored in fp16 and cast to ``dtype`` (fp32 by default, the reference on a CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    from transformers.utils import logging as hf_logging

    where = resolve(name_or_path)
    # transformers draws a "Loading weights" bar for a 9M-parameter model that loads in milliseconds; in a
    # notebook it is a widget that clutters the page. Switch it off for this call only.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(where)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def config_head_dim(config) -> int:
    """The per-head width of a transformers config: ``head_dim`` where the config sets it (Llama may decouple
    it from the hidden size), else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# The one rule for how long a probe is: every stored curve and chapter 12's stored run scores probes of this
# length. Chapter 5's stored curve hashes this function's source text (labsrc.sweeps.kv_quant.scoring_code):
# an edit inside it stales that curve.
def context_len(model) -> int:
    """The probes' length: 90% of the model's trained context, as on its eval card (room for the question)."""
    from labsrc.models.train import PROBE_FRACTION
    return int(PROBE_FRACTION * model.config.lab_trained_context)


def eval_card(name_or_path: str) -> dict:
    """The eval card (``eval_card.json``) written when a shipped or local model was trained."""
    where = Path(resolve(name_or_path))
    card = where / "eval_card.json"
    if not card.is_file():
        raise FileNotFoundError(f"no eval card at {card}")
    return json.loads(card.read_text())


def train_log(name_or_path: str) -> list[dict]:
    """The training log (one dict per step: loss, text loss, answer loss, lr, tokens, seconds; a fine-tuned
    draft's log also names each step's batch by a digest, kept as text)."""
    import csv

    def value(v):
        if v in ("", None):
            return None
        try:
            return float(v)
        except ValueError:  # a batch digest such as '31f5d42706bd'
            return v

    where = Path(resolve(name_or_path))
    with open(where / "train_log.csv") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]

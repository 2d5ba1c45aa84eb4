"""Speculative tree decoding (lossless) and the eval stage.

    decoder = SpecDecoder(target, eos_token_ids)
    out = decoder.generate(prompt_ids, build_drafter("eagle3-tree", head, n_layers, cfg.eval), max_new_tokens=128)
"""

from eval.decoder import Generation, SpecDecoder
from eval.drafters import (
    METHODS,
    Drafter,
    Eagle3Drafter,
    HybridDrafter,
    MedusaDrafter,
    NGramDrafter,
    PlainDrafter,
    build_drafter,
)
from eval.sampling import Sampling, accept, warp
from eval.tree import DraftTree, choice_order, default_medusa_choices, static_tree
from eval.treesize import acceptance_curve, choose_total_tokens, draft_times, measure_verify_time, monotone

__all__ = [
    "METHODS", "DraftTree", "Drafter", "Eagle3Drafter", "Generation", "HybridDrafter", "MedusaDrafter",
    "NGramDrafter", "PlainDrafter", "Sampling", "SpecDecoder", "accept", "acceptance_curve", "build_drafter",
    "choice_order", "choose_total_tokens", "default_medusa_choices", "draft_times", "measure_verify_time", "monotone",
    "static_tree", "warp",
]

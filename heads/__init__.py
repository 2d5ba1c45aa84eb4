"""Draft heads as plain ``nn.Module``s whose parameter names are the exported checkpoint names."""

from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.io import build_head, load_head, load_head_config, save_head
from heads.medusa import MedusaConfig, MedusaHead

__all__ = ["Eagle3Config", "Eagle3Head", "MedusaConfig", "MedusaHead", "build_head", "load_head", "load_head_config",
           "save_head"]

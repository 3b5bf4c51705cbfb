"""LoRA adapters over the base model (issue 43, item 3): PEFT folders read (``peft.py``), mapped onto our
fused layers (``targets.py``), held in slots and applied several in one step (``manager.py``)."""

from apt_serve_ray.lora.manager import LoRAManager, LoRARef

__all__ = ["LoRAManager", "LoRARef"]

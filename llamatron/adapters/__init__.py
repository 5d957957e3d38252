"""Parameter-efficient fine-tuning: LoRA adapters on a frozen model, in PEFT's format at the edges."""

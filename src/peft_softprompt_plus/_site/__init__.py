"""Start-up registration: what runs before torch, transformers or PEFT are imported (standard library only)."""

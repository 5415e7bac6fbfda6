"""Adapter files: crash-safe saving, loading (old and new formats), the Hub, the model card, `inspect`."""

"""Where the method meets other programs: the PEFT patch table (the one place that changes PEFT), the
registration import, and `prompt_embeds` for serving engines."""

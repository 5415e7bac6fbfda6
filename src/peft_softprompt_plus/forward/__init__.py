"""The forward: which adapter each row reads (routing), input checks (validation), the exact semantics (positions,
mask, labels), the prompt's keys/values inside attention (paths, attention), and `generate`."""

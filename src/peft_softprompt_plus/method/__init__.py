"""The method: its config, the tuner PEFT attaches, the prompt bank, inits, reparameterisation, the tied
embedding, precision and task types. Nothing here imports the forward's internals beyond what the tuner routes to,
or any application."""

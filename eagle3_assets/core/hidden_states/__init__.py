"""hidden_states: the target's auxiliary hidden states over every token sequence, in packed safetensors
shards; the rules of their checks; and the exports the training frameworks read. May import: storage,
target_model, generation (served extraction drives the generation engine and its backend protocol), tokens,
report.
"""
